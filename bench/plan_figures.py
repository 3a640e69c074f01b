"""The planner's figures (a benchmark, not a test): Young/Daly on one node, and the 46-node plan.

    .venv/bin/python bench/plan_figures.py [--trials 40] [--replicas 8] [--seeds 5]

1. One node, exponential failures (MTBF 2 h), a 20 s sync checkpoint, 5 s steps: the
   planner's interval over several run seeds, against Young/Daly's sqrt(2 delta M) and Daly's
   higher-order optimum.
2. scenarios/multiregion-46.toml: recommended policy against the checkpoint_restart baseline
   at its Young/Daly interval (goodput and node-hours per useful step), the Pareto front, and
   the wall time of the search.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from keel import scenario as S  # noqa: E402
from keel.paths import DEFAULT_SCENARIO  # noqa: E402
from planner import search  # noqa: E402


def young_daly_single(trials: int, replicas: int, seeds: int) -> None:
    from test_planner import SINGLE_NODE
    delta, mtbf, restart = 20.0, 7200.0, 60.0 + 10.0  # restart_s + checkpoint read (40 GB at 4 GB/s)
    yd_s = math.sqrt(2 * delta * mtbf)
    daly_s = math.sqrt(2 * delta * (mtbf + restart)) * (1 + math.sqrt(delta / (2 * (mtbf + restart))) / 3
                                                        + delta / (9 * 2 * (mtbf + restart))) - delta
    print(f"single node: Young/Daly {yd_s / 5:.1f} steps, Daly's higher order {daly_s / 5:.1f} steps")
    found = []
    for seed in range(seeds):
        t0 = time.perf_counter()
        r = search.run_plan(S.loads(SINGLE_NODE, overrides=[f"run.seed={seed}"]), trials=trials, replicas=replicas,
                            keys=["checkpoint.interval_steps"], progress=False)
        k = r["recommended"]["checkpoint.interval_steps"]
        found.append(k)
        print(f"  seed {seed}: interval {k} steps ({(k - yd_s / 5) / (yd_s / 5):+.1%} vs Young/Daly), "
              f"goodput {r['recommended']['goodput']:.4f} vs baseline {r['baseline']['goodput']:.4f}, "
              f"{r['evaluations']} candidates in {time.perf_counter() - t0:.1f} s")
    print(f"  median {statistics.median(found)} steps; worst {max(abs(k - yd_s / 5) / (yd_s / 5) for k in found):.1%} "
          f"from Young/Daly")


def multiregion(trials: int, replicas: int) -> None:
    t0 = time.perf_counter()
    r = search.run_plan(S.load(DEFAULT_SCENARIO), trials=trials, replicas=replicas, progress=True)
    print(search.table(r, top=5))
    rec, base = r["recommended"], r["baseline"]
    print(f"46 nodes: recommended goodput {rec['goodput']:.4f} vs baseline {base['goodput']:.4f} "
          f"(+{rec['goodput'] - base['goodput']:.4f}); node-hours per useful step {rec['cost_node_hours_per_step']:.5f} "
          f"vs {base['cost_node_hours_per_step']:.5f} ({r['improvement']['cost_ratio'] - 1:+.1%}); "
          f"{r['evaluations']} candidates x {replicas} replicas in {time.perf_counter() - t0:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    young_daly_single(min(args.trials, 12), args.replicas, args.seeds)
    multiregion(args.trials, args.replicas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
