"""The runtime's public entry point (the planner and `keel run` use only this).

    run_scenario(scenario, out_dir, ...) -> summary        # a real run: events.jsonl, summary.json
    commit_sha() -> str                                     # the code's git HEAD, as checkpoints record it
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from keel.scenario import Scenario


def with_steps(scenario: Scenario, steps: int | None) -> Scenario:
    """`--steps N`: run.steps = N; scheduled faults at or beyond step N cannot strike and are
    dropped (with a note on stderr)."""
    if steps is None:
        return scenario
    from keel.errors import InputError
    if steps < 1:
        raise InputError(f"--steps: expected a positive number of steps, got {steps}")
    keep = tuple(e for e in scenario.faults.schedule if e.at_step < steps)
    if len(keep) < len(scenario.faults.schedule):
        dropped = len(scenario.faults.schedule) - len(keep)
        print(f"keel: --steps {steps}: {dropped} scheduled fault(s) at step {steps} or later dropped", file=sys.stderr)
    return dataclasses.replace(scenario, run=dataclasses.replace(scenario.run, steps=steps),
                               faults=dataclasses.replace(scenario.faults, schedule=keep))


def without_faults(scenario: Scenario) -> Scenario:
    return dataclasses.replace(scenario, faults=dataclasses.replace(scenario.faults, schedule=()))


def check_runnable(scenario: Scenario, steps: int | None = None) -> None:
    """InputError for what the runtime would refuse, before any worker starts: fewer than 2
    steps (`steps`, the --steps override, or run.steps: the summary measures the step time
    between commits), a reduction format the runtime lacks, and a job that breaks the job
    contract (runtime/job_check.py; for the built-in job, a corpus cut that `data.shards` and
    `model.context` make unusable): each worker would find the same, exit, and the run fail as
    "every worker process exited" after their start-up, exit 1, half a minute later. `keel
    run`, validate, calibrate and run_scenario call it first."""
    from keel.errors import InputError

    n = steps if steps is not None else scenario.run.steps
    if n < 2:
        what = "--steps" if steps is not None else f"{scenario.source}: key 'run.steps'"
        raise InputError(f"{what}: expected at least 2 steps for a run (its step time is measured "
                         f"between commits), got {n}")

    from runtime.reduction import FORMATS, reduction_format
    if reduction_format(scenario) not in FORMATS:
        raise InputError(f"{scenario.source}: key 'reduction.format': expected one of {', '.join(FORMATS)} "
                         f"for a run (native is a plain all-reduce the twin prices for comparison), "
                         f"got {scenario.reduction.format!r}")

    from runtime.job_check import check_job
    check_job(scenario)  # the job's contract (runtime/job_check.py), in this process: nothing is written


def job_dir_of(scenario: Scenario) -> str | None:
    """Where the workers find a file entry of the scenario's job: its directory, absolute
    (the workers may start in another directory); None for the built-in job."""
    if not scenario.job.entry:
        return None
    from runtime.job_run import scenario_dir
    return str(scenario_dir(scenario))


def run_scenario(scenario: Scenario, out_dir: str | Path, *, steps: int | None = None,
                 resume: str | Path | None = None, no_faults: bool = False,
                 allow_config_change: bool = False, progress: bool = True,
                 listen: str = "127.0.0.1:0", spawn: bool = True, hangs: str | None = None,
                 device: str | None = None, backend: str | None = None) -> dict[str, Any]:
    """Run `scenario` for real: this process supervises (runtime/supervisor.py) a coordinator
    process, restarted if it dies, and one worker process per node. Writes
    `out_dir/events.jsonl` and `out_dir/summary.json`; returns the summary. Raises
    `keel.errors.RunFailed` if the run could not complete, `InputError` for bad input.
    `device`/`backend` default to $KEEL_DEVICE ("cpu") and $KEEL_BACKEND ("gloo"; "nccl" needs
    a GPU per worker)."""
    import os
    from keel.durable import check_dir_path, check_resume_dir, check_writable_dir
    check_dir_path(out_dir)  # bad directories are refused before anything is written, imported or started
    if resume is not None:
        check_resume_dir(resume)
    check_runnable(scenario, steps)
    if resume is not None:
        if allow_config_change:  # a changed model shape: found here, not once every worker has started
            from runtime.resume_check import check_resume_shapes
            check_resume_shapes(scenario, resume)
    check_writable_dir(out_dir)
    if scenario.emulation.enabled and scenario.emulation.time_scale == "auto":  # measured here, once
        from runtime.capacity import check_machine
        scenario = check_machine(scenario, "the run", progress)
    from keel.rundir import write_summary
    from runtime.supervisor import Supervisor

    scenario = with_steps(scenario, steps)
    if no_faults:
        scenario = without_faults(scenario)
    out = Path(out_dir)
    options = {"resume": str(resume) if resume is not None else None, "allow_config_change": allow_config_change,
               "progress": progress, "hangs": hangs, "device": device or os.environ.get("KEEL_DEVICE", "cpu"),
               "backend": backend or os.environ.get("KEEL_BACKEND", "gloo"), "job_dir": job_dir_of(scenario)}
    if scenario.job.entry:  # the fork server imports the job's libraries once, for every worker it forks
        from runtime.coordinator.procs import preload_job
        preload_job(scenario.job.entry, options["job_dir"])
    supervisor = Supervisor(scenario, out, listen=listen, spawn=spawn, options=options)  # locks `out`
    try:
        summary = supervisor.run()
        write_summary(out, summary)
    finally:
        supervisor.close()
    return summary


def commit_sha() -> str:
    """40 hex of the code's git HEAD, or "unknown" outside a git checkout."""
    from runtime.checkpoint import current_commit_sha
    return current_commit_sha()
