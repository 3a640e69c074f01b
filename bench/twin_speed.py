"""How fast the twin simulates: simulated time per wall second and events per second for
clusters of 46, 512, 2,048 and 16,384 nodes (the 46-node scenario's four regions and fault
rates, scaled), over 30 days, plus the 54-day run of 2,048 nodes (a 16,384-GPU frontier run).

    .venv/bin/python bench/twin_speed.py [--repeat N] [--case NODESxDAYS ...] [--json]

Targets on the project's 2-core machine: 30 days of 46 nodes in < 1 s; 54 days of 2,048 nodes
in < 10 s. Cost should grow with the events (faults, checkpoints, re-slots), not nodes x steps.
"""
from __future__ import annotations

import argparse
import keel.scenario
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keel.scenario import load, from_dict  # noqa: E402

import twin  # noqa: E402
from twin.model import Simulation  # noqa: E402
from twin.params import TwinParams  # noqa: E402

BASE = Path(__file__).resolve().parents[1] / "scenarios" / "multiregion-46.toml"
CASES = [(46, 30, 1.0), (512, 30, None), (2048, 30, None), (16384, 30, None), (2048, 54, 10.0)]
DAY = 86400.0


def scaled(nodes: int, days: float) -> "keel.scenario.Scenario":
    """The 46-node scenario with `nodes` nodes in the same regional proportions, one slot per
    training node, 4% hot spares, and as many steps as `days` of fault-free training."""
    raw = load(BASE).to_dict()
    weights = [r["nodes"] for r in raw["regions"]]
    counts = [max(1, math.floor(nodes * w / sum(weights))) for w in weights]
    counts[0] += nodes - sum(counts)
    for region, n in zip(raw["regions"], counts):
        region["nodes"] = n
    raw["policy"]["hot_spares"] = 2 if nodes == 46 else max(2, round(nodes * 2 / 46))
    raw["workload"]["slots"] = 0
    raw["run"]["name"] = f"scaled-{nodes}"
    raw["faults"]["schedule"] = []
    probe = from_dict(raw, f"scaled-{nodes}")
    step_s = Simulation(probe, TwinParams.from_scenario(probe), 0).healthy_step_s
    raw["run"]["steps"] = int(days * DAY / step_s)
    return from_dict(raw, f"scaled-{nodes}")


def measure(nodes: int, days: float, repeat: int) -> dict:
    scenario = scaled(nodes, days)
    best = math.inf
    result = None
    for seed in range(repeat):
        t0 = time.perf_counter()
        result = twin.simulate(scenario, seed=seed)
        best = min(best, time.perf_counter() - t0)
    s = result.summary
    return {"nodes": nodes, "days": days, "steps": scenario.run.steps, "wall_s": best,
            "simulated_days": s["wall_s"] / DAY, "sim_s_per_wall_s": s["wall_s"] / best,
            "events": len(result.events), "events_per_s": len(result.events) / best,
            "faults": len(s["faults"]), "restarts": s["restarts"], "goodput": s["goodput"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (seeds 0..N-1); the fastest counts")
    ap.add_argument("--case", action="append", default=[], metavar="NODESxDAYS",
                    help="only these of the cases (46x30, 512x30, 2048x30, 16384x30, 2048x54); repeatable")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    known = {f"{n}x{d}": (n, d, t) for n, d, t in CASES}
    unknown = [c for c in args.case if c not in known]
    if unknown:
        print(f"twin_speed: --case {unknown[0]!r}: expected one of {', '.join(known)}", file=sys.stderr)
        return 2
    rows = []
    for nodes, days, target in [known[c] for c in args.case] or CASES:
        row = measure(nodes, days, args.repeat)
        row["target_s"] = target
        row["ok"] = None if target is None else row["wall_s"] < target
        rows.append(row)
        if not args.json:
            print(f"  measured {nodes} nodes x {days} days: {row['wall_s']:.2f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    header = f"{'nodes':>6} {'days':>5} {'steps':>9} {'faults':>7} {'events':>7} {'wall s':>8} " \
             f"{'sim s / wall s':>15} {'events / s':>11} {'goodput':>8}  target"
    print(header)
    print("-" * len(header))
    for r in rows:
        target = "-" if r["target_s"] is None else f"< {r['target_s']:.0f} s: {'met' if r['ok'] else 'MISSED'}"
        print(f"{r['nodes']:>6} {r['days']:>5} {r['steps']:>9} {r['faults']:>7} {r['events']:>7} "
              f"{r['wall_s']:>8.3f} {r['sim_s_per_wall_s']:>15.3g} {r['events_per_s']:>11.0f} "
              f"{r['goodput']:>8.4f}  {target}")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
