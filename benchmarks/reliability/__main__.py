"""``python -m benchmarks.reliability [--quick] [--only NAME ...] [--json OUT.json]``.

There is no other system run beside ours: the anchor is the required result of each fault
(the issue's table, after Knative's HA tests and the availability a platform team quotes),
and the ratio is the share of faults that meet it (goal 1.0).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.machine import write_result
from benchmarks.reliability.table import FULL, QUICK, bed_faults, markdown, run_table


def main(argv: list[str] | None = None) -> dict:
    names = [name for name, _ in bed_faults(FULL)] + ["registry"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="saturation 1 min, long generation 100 s, 30 s watching the restarted autoscaler")
    parser.add_argument("--only", nargs="+", choices=names, help="run these faults only")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--work-dir", help="keep the platform's state and the loops' records here")
    args = parser.parse_args(argv)
    durations = QUICK if args.quick else FULL
    started = time.monotonic()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="modelplane-faults-"))
    results = []
    for result in run_table(root, durations, set(args.only or []), log=lambda m: print(m, flush=True)):
        print(f"{'met' if result.passed else 'MISSED'}: {result.fault}: sent {result.sent}, ok {result.ok}, "
              f"refused {result.refused}, failed {result.failed}, lost {result.lost}, detect {result.detect_s} s, "
              f"recover {result.recover_s} s; {result.notes}", flush=True)
        results.append(result)
    print(markdown(results))
    met = sum(r.passed for r in results)
    sent = sum(r.sent for r in results)
    answered = sum(r.ok + r.refused for r in results)
    return write_result(
        args.json, benchmark="reliability",
        ours={"faults": [r.as_dict() for r in results], "requests_sent": sent, "requests_answered_or_refused": answered,
              "answered_share": round(answered / sent, 5) if sent else None, "quick": args.quick,
              "durations_s": vars(durations), "run_s": round(time.monotonic() - started, 1)},
        anchor={"required": {r.fault: r.required for r in results}},
        ratio=met / len(results) if results else float("nan"),
        goal="every fault meets its required result (ratio 1.0)", meets_goal=bool(results) and met == len(results))


if __name__ == "__main__":
    main()
