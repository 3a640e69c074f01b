"""`keel simulate SCENARIO [--set k=v] [--seed N] [--replicas N] [--calibration FILE] [--out DIR] [--json]`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from keel.errors import InputError
from keel.rundir import EVENTS, SUMMARY, print_json, write_run
from keel.scenario import load
from twin.model import WALL_LIMIT_FACTOR


def simulate(args: argparse.Namespace) -> int:
    import twin
    from twin.params import load_calibration

    scenario = load(args.scenario, args.overrides)
    calibration = load_calibration(args.calibration) if args.calibration else None
    replicas = args.replicas
    if replicas < 1:
        raise InputError(f"--replicas: expected at least 1, got {replicas}")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: expected a directory, found a file")
    if replicas == 1:
        result = twin.simulate(scenario, seed=args.seed, calibration=calibration)
        summary, events = result.summary, result.events
    else:
        summary = twin.simulate_replicas(scenario, replicas, seed=args.seed, calibration=calibration,
                                         progress=True)
        events = twin.simulate(scenario, seed=summary["seed"], calibration=calibration).events
    if out is not None:
        write_run(out, events, summary)
    if args.json:
        print_json(summary)
    else:
        print(headline(summary))
        if replicas == 1:
            print(fault_table(summary["faults"]))
        if out is not None:
            print(f"wrote {out / EVENTS} and {out / SUMMARY}")
    return 0


def headline(summary: dict[str, Any]) -> str:
    """`multiregion-46: 46 nodes, 4 regions, 1 scheduled + 7 drawn faults absorbed, 0 restarts, goodput 0.962`."""
    head = f"{summary['scenario']}: {summary['nodes']} nodes, {summary['regions']} regions, "
    if "replicas" in summary:
        lo, hi = summary["goodput_ci95"]
        return (head + f"{summary['replicas']} replicas, {summary['faults']:.1f} faults and "
                f"{summary['restarts']:.2f} restarts a run, goodput {summary['goodput']:.3f} "
                f"(95% CI {lo:.3f}-{hi:.3f})")
    faults = summary["faults"]
    restarted = sum(1 for f in faults if f["action"] == "checkpoint_restart")
    counts = f"{summary['faults_scheduled']} scheduled + {summary['faults_drawn']} drawn faults"
    fate = "absorbed" if not restarted else f"({len(faults) - restarted} absorbed, {restarted} restarted)"
    line = head + f"{counts} {fate}, {summary['restarts']} restarts, goodput {summary['goodput']:.3f}"
    if not summary.get("completed", True):
        line += (f" (did not finish: {summary['steps']} steps committed when the twin stopped it at"
                 f" {summary['wall_s'] / 3600:.0f} h, {WALL_LIMIT_FACTOR:.0f}x its fault-free time)")
    return line


def fault_table(faults: list[dict[str, Any]]) -> str:
    if not faults:
        return "no faults"
    header = ("id", "t (h)", "step", "class", "target", "action", "downtime_s", "cost_s", "lost_steps")
    rows = [header] + [
        (str(f["fault_id"]), f"{f['t'] / 3600:.2f}", str(f["at_step"]), f["class"], f["target"],
         f["action"] or "-", f"{f['downtime_s']:.2f}", f"{f['cost_s']:.2f}", str(f["lost_steps"]))
        for f in faults]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = {0, 1, 2, 6, 7, 8}
    lines = ["  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(lines)
