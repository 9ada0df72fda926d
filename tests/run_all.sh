#!/usr/bin/env bash
# `make test`: the fault table and the rest of the suite at the same time, on the same cores.
#
# The fault table (tests/test_faults.py, one process) runs at normal priority; the rest of the
# suite (tests/run.sh, its parallel workers) runs under `nice -n $MODELPLANE_SUITE_NICE` (default
# 10). Alone, the fault table leaves about a third of 2 cores idle (it waits on recoveries and
# fixed load windows) and the suite is bound by the cores: side by side, the suite takes what
# the fault table leaves, and where both want a core the fault table's processes, whose faults
# are judged against deadlines, get it first (Linux's fair scheduler weighs a nice-10 process at
# about a tenth of a nice-0 one). The suite's own checks have no deadline a slower core misses.
#
# The suite's output streams as it runs; the fault table's goes to a log that is printed when
# both have finished. The exit status is non-zero when either failed.
set -uo pipefail
cd "$(dirname "$0")/.."

log_dir="${MODELPLANE_TEST_LOG_DIR:-.modelplane-test}"
mkdir -p "$log_dir"
faults_log="$log_dir/faults.log"
echo "the fault table runs beside the suite; its output ($faults_log) follows the suite's"

MODELPLANE_TEST_WORKERS=0 bash tests/run.sh -m faults tests/test_faults.py "$@" >"$faults_log" 2>&1 &
faults_pid=$!
trap 'kill -TERM "$faults_pid" 2>/dev/null' INT TERM

nice -n "${MODELPLANE_SUITE_NICE:-10}" bash tests/run.sh -m "not faults" "$@"
suite_status=$?
wait "$faults_pid"
faults_status=$?

echo
echo "======================== the fault table ($faults_log) ========================"
cat "$faults_log"
echo "suite: exit status $suite_status; fault table: exit status $faults_status"
[ "$suite_status" = 0 ] && [ "$faults_status" = 0 ]
