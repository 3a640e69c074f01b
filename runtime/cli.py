"""`keel run SCENARIO [--set k=v]... [--steps N] [--out DIR] [--resume DIR] [--allow-config-change]
[--no-faults] [--coordinator HOST:PORT] [--json]`.

Without `--coordinator`: this process is the coordinator and spawns one worker per node.
With `--coordinator HOST:PORT`: this process is one worker joining that coordinator (the
coordinator, started with `python -m runtime.coordinator`, owns the scenario and the log).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from keel.rundir import print_json


def run(args: argparse.Namespace) -> int:
    if args.coordinator:
        from runtime.worker import main as worker_main
        return worker_main(["--coordinator", args.coordinator])
    from keel.scenario import load
    from runtime.api import run_scenario

    scenario = load(args.scenario, args.overrides)
    if args.out:
        out = Path(args.out)
    elif args.resume:
        out = Path(args.resume)
    else:
        out = Path("runs") / scenario.run.name / time.strftime("%Y%m%d-%H%M%S")
    summary = run_scenario(scenario, out, steps=args.steps, resume=args.resume, no_faults=args.no_faults,
                           allow_config_change=args.allow_config_change, progress=True)
    if args.json:
        print_json(summary)
    else:
        faults = summary["faults"]
        absorbed = sum(1 for f in faults if f["action"] != "checkpoint_restart")
        print(f"{summary['scenario']}: {summary['steps']} steps in {summary['wall_s']:.1f} s, "
              f"step {summary['step_time_s'] * 1000:.1f} ms, goodput {summary['goodput']:.3f}, "
              f"faults {len(faults)} ({absorbed} absorbed), restarts {summary['restarts']}; "
              f"final loss {summary['losses'][-1] if summary['losses'] else float('nan'):.4f}; "
              f"weights {summary['final_weights_sha256'][:16]}...; out {out}")
        for f in faults:
            print(f"  fault {f['fault_id']}: {f['class']} {f['target']} at step {f['at_step']}: "
                  f"{f['action']}, downtime {f['downtime_s']:.3f} s, cost {f['cost_s']:.3f} s", file=sys.stdout)
    return 0
