#!/usr/bin/env bash
# Runs the whole suite (`make test` calls this after creating the environments).
# Needs the PostgreSQL server on 127.0.0.1:5432 (user postgres, trust auth); starts it
# when it is installed here but stopped.
#
# The test modules run on MODELPLANE_TEST_WORKERS parallel workers (pytest-xdist, default 3:
# alone, the suite kept 2 cores 60 % busy, waiting on servers and processes; 3 workers keep them
# busy without crowding the engines more than that); each module's tests stay together, in order,
# on one worker (`--dist loadscope`), the longest modules first (tests/conftest.py).
# MODELPLANE_TEST_WORKERS=0 runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python - <<'PY' 2>/dev/null
import psycopg
psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", connect_timeout=3).close()
PY
then
  if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql >/dev/null 2>&1; then
    echo "starting the local PostgreSQL server"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  else
    echo "PostgreSQL is not reachable on 127.0.0.1:5432: its tests will be skipped (they fail under CI=true)"
  fi
fi

# modelplane's own bytecode, once: uv compiles the environment's at install, but nothing writes ours
# where PYTHONDONTWRITEBYTECODE is set (as on CI machines), and every process of the run (services,
# run workers, replicas) would compile the modules it imports again (0.2 CPU-s for the code location).
packages=()
for init in */__init__.py; do [ "${init%%/*}" = tests ] || packages+=("${init%%/*}"); done
.venv/bin/python -m compileall -q -j 0 "${packages[@]}" >/dev/null

workers="${MODELPLANE_TEST_WORKERS:-3}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -p no:cacheprovider --durations=25 "${parallel[@]}" "$@"
