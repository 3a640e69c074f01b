"""`keel run SCENARIO [--set k=v]... [--steps N] [--out DIR] [--resume DIR] [--allow-config-change]
[--no-faults] [--emulate [--time-scale X]] [--coordinator HOST:PORT] [--json]`.

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


def resume_note(out: Path, argv: list[str]) -> str:
    """What a stopped run leaves: its newest complete checkpoint and the command that resumes
    from it (this command line, `argv`, resuming from `out`)."""
    import shlex
    from runtime.checkpoint_read import newest_in_run
    latest = newest_in_run(out)
    if latest is None:
        return f"no checkpoint was completed in {out}; nothing to resume from"
    argv, skip = [], False
    for a in argv:  # this command line without its --out/--resume
        if skip:
            skip = False
        elif a in ("--out", "--resume"):
            skip = True
        elif not a.startswith(("--out=", "--resume=")):
            argv.append(a)
    command = shlex.join(["keel", *argv, "--resume", str(out)])
    return f"the last complete checkpoint is {latest}; resume with: {command}"


def run(args: argparse.Namespace) -> int:
    if args.coordinator:
        from runtime.worker import main as worker_main
        return worker_main(["--coordinator", args.coordinator])
    from keel.scenario import load
    from runtime.api import run_scenario

    from keel.errors import InputError
    from keel.scenario import override_text
    overrides = list(args.overrides)
    if args.emulate:
        overrides.append(override_text("emulation.enabled", True))
    if args.time_scale is not None:
        overrides.append(override_text("emulation.time_scale", args.time_scale))
    scenario = load(args.scenario, overrides)
    if args.time_scale is not None and not scenario.emulation.enabled:
        raise InputError("--time-scale: only an emulated run has a time scale "
                         "(add --emulate, or set emulation.enabled = true)")
    if args.out:
        out = Path(args.out)
    elif args.resume:
        out = Path(args.resume)
    else:
        out = Path("runs") / scenario.run.name / time.strftime("%Y%m%d-%H%M%S")
    from keel.durable import check_dir_path, check_resume_dir
    from keel.rundir import check_not_in_use
    check_dir_path(out)  # what is known of the directories without writing: before the job's imports
    check_not_in_use(out)
    if args.resume:
        check_resume_dir(args.resume)
        check_not_in_use(args.resume, "--resume")
    from runtime.api import check_runnable
    check_runnable(scenario, args.steps)  # before anything is written or started
    from runtime.capacity import check_machine
    scenario = check_machine(scenario)  # processes, memory, an emulation's time scale (auto: chosen): before any start
    try:
        summary = run_scenario(scenario, out, steps=args.steps, resume=args.resume, no_faults=args.no_faults,
                               allow_config_change=args.allow_config_change, progress=True)
    except KeyboardInterrupt as e:  # every process of the job has exited (the supervisor's finally)
        e.note = resume_note(out, getattr(args, "argv", sys.argv[1:]))
        raise
    for c in summary.get("checkpoints", []):  # a full disk does not stop the run, but it is said
        if c.get("error"):
            print(f"keel: warning: the checkpoint of step {c['step']} was not written ({c['error']}); "
                  f"resuming would start from an earlier one", file=sys.stderr)
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
        clock = " (emulated)" if "emulation" in summary else ""
        for f in faults:
            print(f"  fault {f['fault_id']}: {f['class']} {f['target']} at step {f['at_step']}: "
                  f"{f['action']}, downtime {f['downtime_s']:.3f} s{clock}, cost {f['cost_s']:.3f} s", file=sys.stdout)
        emu = summary.get("emulation")
        if emu:
            print(f"  emulated cluster at time scale {emu['time_scale']:g}: {emu['overruns']} of {emu['reports']} "
                  f"step reports late ({emu['overrun_fraction']:.1%}, limit {emu['max_overrun_fraction']:.0%}; "
                  f"worst {emu['worst_late_s']:.3f} s), {emu['compute_overruns']} compute overruns; "
                  f"first steps (warm-up, not counted) up to {emu['warmup_late_s']:.3f} s late"
                  f"{'' if emu['faithful'] else ': NOT a faithful emulation'}")
    emu = summary.get("emulation")
    if emu and not emu.get("faithful", True):  # its times are the machine's, not the cluster's: not a result
        print(f"keel: run failed: the emulation was not faithful ({emu['overruns']} of {emu['reports']} step reports "
              f"late, limit {emu['max_overrun_fraction']:.0%}); its times are not the emulated cluster's "
              f"(a larger emulation.time_scale keeps them)", file=sys.stderr)
        return 1
    return 0
