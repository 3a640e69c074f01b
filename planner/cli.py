"""The planner's subcommands: `keel calibrate`, `keel validate`, `keel plan` (wired in keel/cli.py).

`--json` prints one JSON object on stdout and nothing else there; progress and notes go to
stderr. Bad input raises `InputError` (exit 2), a failed run `RunFailed` (exit 1).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from keel.errors import InputError
from keel.rundir import print_json, write_json

from planner.calibrate_fit import QUICK_ENV, quick_from_env  # noqa: F401 (QUICK_ENV: its documented name)


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise InputError(f"{flag}: expected a positive integer, got {value}")
    return value


def calibrate(args: Any) -> int:
    from planner import calibrate as C
    quick = getattr(args, "quick", False) or quick_from_env()
    base = args.loaded
    if base.emulation.time_scale == "auto":  # calibrate runs emulated at the scale this machine keeps
        from runtime.capacity import check_machine
        base = check_machine(base.with_overrides({"emulation.enabled": True}), "keel calibrate")
    cal = C.calibrate(quick=quick, base=base, progress=True)
    path = C.write(cal, args.out)
    if args.json:
        print_json(cal)
    else:
        print(C.table(cal))
        print(f"written to {path}")
    return 0


def validate(args: Any) -> int:
    from planner import validate as V
    scenario = args.loaded
    out = Path(args.out or f"runs/validate-{scenario.run.name}")
    from runtime.capacity import check_machine
    scenario = check_machine(V.prepare(scenario), "keel validate")  # an unfaithful emulation is refused before any run
    from keel.rundir import RunDirLock
    with RunDirLock(out):  # one validation per directory (each repetition's run locks its own)
        comparison = V.validate(scenario, out_dir=out, calibration=args.calibration, progress=True)
    if args.json:
        print_json(comparison)
    else:
        print(V.table(comparison))
        print(f"written to {out / 'comparison.json'}")
    return 0 if comparison["pass"]["all"] else 1


def plan(args: Any) -> int:
    from planner import search
    scenario = args.loaded
    trials = _positive(args.trials, "--trials")
    replicas = _positive(args.replicas, "--replicas")
    if args.validate:
        from planner.validate import LOCAL_MAX_NODES
        if scenario.total_nodes > LOCAL_MAX_NODES:
            raise InputError(f"{scenario.source}: --validate runs the policies on the runtime here; expected a "
                             f"local scenario of at most {LOCAL_MAX_NODES} nodes (such as scenarios/local-8.toml), "
                             f"got {scenario.total_nodes}")
    calibration = None
    if getattr(args, "calibration", None):  # where keel/cli.py offers plan --calibration
        from twin import load_calibration
        calibration = load_calibration(args.calibration)
    result = search.run_plan(scenario, trials=trials, replicas=replicas, ray_address=args.ray,
                             calibration=calibration, progress=True)
    out = Path(args.out) if args.out else None
    if args.validate:
        from planner.validate import check_plan
        result["validation"] = check_plan(scenario, result, (out or Path(f"runs/plan-{scenario.run.name}")) / "validate")
    if out is not None:
        write_json(out / "plan.json", result)
    if args.json:
        print_json(result)
    else:
        print(search.table(result))
        if args.validate:
            v = result["validation"]
            print(f"runtime check: recommended goodput {v['recommended']['observed_goodput']:.3f} "
                  f"(predicted {v['recommended']['predicted_goodput']:.3f}), baseline "
                  f"{v['baseline']['observed_goodput']:.3f} (predicted {v['baseline']['predicted_goodput']:.3f}); "
                  f"ordering {'matches' if v['ordering_matches'] else 'DOES NOT match'}")
        if out is not None:
            print(f"written to {out / 'plan.json'}")
    if args.validate and not result["validation"]["ordering_matches"]:
        return 1
    return 0
