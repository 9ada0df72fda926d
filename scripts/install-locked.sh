#!/usr/bin/env bash
# Install a lock file's exact packages into a virtual environment (the Makefile's `envs`).
#
# usage: scripts/install-locked.sh VENV LOCKFILE [EXTRA_INDEX_URL]
#
# With uv (pinned below, installed into VENV by pip) when it can: it installed both lock files at
# once, bytecode compiled, in 59 s on 2 cores here from an empty cache, pip in 2 min 11 s. The
# bytecode is compiled at install (as pip does) because nothing writes it later where
# PYTHONDONTWRITEBYTECODE is set, as on CI machines: every vLLM process would compile vLLM's
# sources again (a tiny Llama's engine start here: 63 CPU-s without bytecode, 27 with). uv does not read
# pip's configuration, so where pip is told to look for packages (pip.conf and PIP_* variables:
# index-url, extra-index-url, find-links, as `pip config list` shows them) is handed on to it,
# with EXTRA_INDEX_URL (the Makefile's TORCH_INDEX_URL). Where uv is not installable or fails,
# pip installs the same lock file, and the reason is printed.
set -euo pipefail
venv=$1
lock=$2
extra_index=${3:-}
UV_VERSION=0.13.8
PIP_VERSION=25.3
python="$venv/bin/python"

# pip's sources as uv arguments: a file:// index that is not there is left out, as pip does.
uv_sources() {
  "$python" -m pip config list 2>/dev/null | "$python" -c '
import os, shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
seen = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    if not flag:
        continue
    for source in shlex.split(value)[0].split() if value else ():
        path = source[len("file://"):] if source.startswith("file://") else source
        if "://" not in path and not os.path.exists(path):
            continue
        if (flag, source) not in seen:
            seen.append((flag, source))
for flag, source in seen:
    print(flag)
    print(source)
'
}

if "$python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"; then
  mapfile -t sources < <(uv_sources)
  if "$venv/bin/uv" pip install -q --python "$python" --no-deps --compile-bytecode --index-strategy unsafe-best-match \
      "${sources[@]}" ${extra_index:+--extra-index-url "$extra_index"} -r "$lock"; then
    exit 0
  fi
  echo "uv $UV_VERSION could not install $lock (above); installing it with pip $PIP_VERSION"
else
  echo "uv $UV_VERSION is not installable here; installing $lock with pip $PIP_VERSION"
fi
"$python" -m pip install -q --upgrade "pip==$PIP_VERSION"
"$venv/bin/pip" install -q --no-deps ${extra_index:+--extra-index-url "$extra_index"} -r "$lock"
