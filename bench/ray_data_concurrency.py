"""How many of a pass's tasks run at once: the pipeline's per-file map against the same map on Ray Data's defaults.

    .venv/bin/python bench/ray_data_concurrency.py                                  # 32 tasks of 0.4 s, 2 CPUs
    .venv/bin/python bench/ray_data_concurrency.py --seconds 2.5                    # filter-pass-sized tasks
    .venv/bin/python bench/ray_data_concurrency.py --tasks 4 --seconds 0.05 --rounds 1   # smallest

Each pass of ``python -m pipeline run`` is one Ray Data map over its input files, one task per file
(``pipeline.executor.file_pass``). This runs that map over ``--tasks`` items whose function keeps one CPU busy
for ``--seconds`` (the WET bench's tokenize pass: 32 files of about 0.4 s; its filter pass: about 2.5 s), on a
local Ray of ``--cpus`` CPUs, twice a round: as the pipeline builds it, and the same map with Ray Data's default
operator reservation back on. Both sides run the same tasks on the same warm workers (a warm-up map runs first,
outside the timings), in an order that alternates over rounds. Per side it prints the wall from submitting the map
to its last row, the tasks running on average (the tasks' summed busy time over that wall; ``--cpus`` is the most
possible) and the delay until the first task starts, as median [IQR] over rounds, and the per-round ratio of the
walls. A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spread import median_iqr_text, quartiles  # noqa: E402  (bench/spread.py, beside this script)

from pipeline.executor import file_pass  # noqa: E402

SIDES = ("pipeline's map", "Ray Data defaults")


def busy_task(item: dict, seconds: float) -> dict:
    """Keep one CPU busy for ``seconds`` (a pass's work is CPU-bound), and say when it ran."""
    started = time.time()
    spins = 0
    while time.time() - started < seconds:
        spins += 1
    return {"started": started, "ended": time.time()}


def run_side(side: str, tasks: int, seconds: float) -> dict[str, float]:
    from ray.data import DataContext

    ds = file_pass([{"index": i} for i in range(tasks)], busy_task, {"seconds": seconds})
    if side == SIDES[1]:
        # The one setting file_pass changes, put back to the library's default.
        ds.context.op_resource_reservation_enabled = DataContext().op_resource_reservation_enabled
    submitted = time.time()
    rows = list(ds.iter_rows())
    wall = time.time() - submitted
    busy = sum(r["ended"] - r["started"] for r in rows)
    return {"wall": wall, "running": busy / wall, "first_start": min(r["started"] for r in rows) - submitted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=32, help="tasks in each map, one per input file (default 32)")
    parser.add_argument("--seconds", type=float, default=0.4, help="CPU seconds each task takes (default 0.4)")
    parser.add_argument("--cpus", type=int, default=2, help="the local Ray's CPUs (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the sides' order alternating (default 3)")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.seconds <= 0 or args.cpus < 1 or args.rounds < 1:
        parser.error("--tasks, --seconds, --cpus and --rounds must be positive")

    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        run_side(SIDES[0], args.cpus, 0.01)  # start the workers outside the timings
        results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        ratios = []
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                results[side].append(run_side(side, args.tasks, args.seconds))
                print(f"round {r + 1}/{args.rounds}: {side} {results[side][-1]['wall']:.2f} s", file=sys.stderr)
            ratios.append(results[SIDES[1]][-1]["wall"] / results[SIDES[0]][-1]["wall"])
    finally:
        ray.shutdown()

    ideal = args.tasks * args.seconds / args.cpus
    print(
        f"{args.tasks} tasks of {args.seconds:g} CPU-seconds on a local Ray of {args.cpus} CPUs, {args.rounds} "
        f"round(s), order alternating; median [IQR] over rounds. All CPUs busy throughout would take {ideal:.2f} s.\n"
    )
    print("| map | wall, s | tasks running on average | first task starts after, s |")
    print("|---|---:|---:|---:|")
    for side in SIDES:
        rows = results[side]
        print(
            f"| {side} | {median_iqr_text([x['wall'] for x in rows], '{:.2f}')} "
            f"| {median_iqr_text([x['running'] for x in rows], '{:.2f}')} "
            f"| {median_iqr_text([x['first_start'] for x in rows], '{:.2f}')} |"
        )
    med, q1, q3 = quartiles(ratios)
    print(f"\nRay Data defaults' wall / the pipeline map's wall, per round: {med:.2f}x [{q1:.2f}–{q3:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
