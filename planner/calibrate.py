"""`keel calibrate [SCENARIO]`: measure what is real in an emulated run of the scenario, the
runtime's own recovery work (planner/calibrate_fit.py says what and how), with the machine and
versions it was measured on. Everything else the twin takes from the scenario: in an emulated
cluster compute, network, storage and detection take the scenario's times.

The runs go through `runtime.api.run_scenario`, emulated at the scenario's `time_scale`, with a
seed and a schedule of their own (never the schedule a validation then judges): a training
node killed early (a hot spare takes over where the scenario has one), then the coordinator
killed (its supervisor starts a successor), then the scenario's last region lost whole; no
straggler is moved (NO_STRAGGLERS). The
real work is the same whatever the schedule, but for the size of the group re-formed (the
comment on KILL_AT below); its figure in emulated
seconds is real seconds / time_scale, so a calibration holds for the node count and time scale
it was measured at (`reference`), and validate refuses one measured at another.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from keel import scenario as S
from keel.calibration import FORMAT, FORMAT_VERSION, table, write  # noqa: F401 (table, write: planner/cli.py)
from keel.errors import RunFailed
from planner.calibrate_fit import RUN_KEYS, fit_calibration, run_samples
from planner.scenario_gen import FAULT_GAP_STEPS

# The kill's episode is over (three commits after it) before the coordinator dies. The
# coordinator dies before the rack loss, so its successor forms a group of every trained node,
# as a validation's coordinator loss mostly does: a group forms more slowly the more members it
# has, and killed after the rack loss (until 7 Dec) it timed the re-form of a smaller group,
# 0.47 s against 1.0-1.2 s in sweep member 2/5's repetitions. The rack loss comes
# FAULT_GAP_STEPS later, as in the sweep's scenarios (planner/scenario_gen.py), with the
# failover over (the workers train on through the outage and its commits land when the
# successor is up), and the run keeps four steps for the generation after it (its pace:
# calibrate_fit.generation_mean_step_s).
KILL_AT, COORDINATOR_AT = 3, 7
RACK_AT = COORDINATOR_AT + FAULT_GAP_STEPS
STEPS = RACK_AT + 4
# No straggler is moved in a calibration run (policy.straggler_window past its last step): the
# runs time re-forms, and a straggler's park or move back that lands next to one adds to it
# what is not that re-form's. Sweep member 3/8 (straggler_factor 1.3, window 1): a straggler's
# slot moved at step 3 and back just after the node was killed, and that abort waited for the
# dead node's detection, 4.2 s of `spare_takeover_s` (10.2 s before its group's connects were
# made abortable, docs/runtime.md); the validation's own takeovers took 0.4 s.
NO_STRAGGLERS = STEPS + 1


def repetitions(quick: bool) -> int:
    """Emulated runs: each gives one sample of every primitive."""
    return 2 if quick else 3


def machine() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cpu_model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu_model)
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_bytes": mem}


def versions() -> dict[str, Any]:
    import importlib.metadata as md
    out: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "simpy", "networkx", "optuna", "keel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        from runtime.api import commit_sha
        out["commit_sha"] = commit_sha()
    except Exception:  # calibration must not fail on a missing git
        out["commit_sha"] = "unknown"
    return out


def calibration_scenario(base: S.Scenario) -> S.Scenario:
    """The scenario, emulated, with the calibration's seed and schedule (module docstring)."""
    trained = base.node_names[: base.training_nodes]
    last = base.regions[-1]
    return base.with_overrides({
        "run.name": f"{base.run.name}-calibration", "run.seed": base.run.seed + 1000, "run.steps": STEPS,
        "emulation.enabled": True, "checkpoint.interval_steps": 1000, "policy.straggler_window": NO_STRAGGLERS,
        "faults": {"schedule": [
            {"at_step": KILL_AT, "class": "hardware_fault", "target": trained[min(1, len(trained) - 1)]},
            {"at_step": COORDINATOR_AT, "class": "coordinator_loss"},
            {"at_step": RACK_AT, "class": "partial_cluster_loss", "target": last.name, "nodes": last.nodes}]}})


HOLDS_FOR = ("nodes", "time_scale")  # the keys of `reference` a calibration must match to be used


def reference(base: S.Scenario) -> dict[str, Any]:
    """What a calibration was measured on; it holds for the emulated cluster's size and time
    scale (HOLDS_FOR)."""
    return {"scenario": base.run.name, "source": str(base.source), "nodes": base.total_nodes,
            "training_nodes": base.training_nodes, "time_scale": base.emulation.time_scale}


def run_once(scenario: S.Scenario, out_dir: Path, failures: list[dict[str, str]]) -> list:
    """One emulated run; a run that fails is recorded and tried once more in a fresh directory."""
    from keel.rundir import read_events
    from runtime.api import run_scenario
    try:
        run_scenario(scenario, out_dir, progress=False)
    except RunFailed as e:
        failures.append({"run": str(out_dir), "error": str(e)})
        print(f"calibrate: emulated run {out_dir} failed ({e}); trying it once more", file=sys.stderr)
        out_dir = Path(f"{out_dir}-retry")
        run_scenario(scenario, out_dir, progress=False)
    return read_events(out_dir)


def measure(base: S.Scenario, work: Path, reps: int, say: Callable[[str], None],
            failures: list[dict[str, str]]) -> dict[str, list[float]]:
    sc = calibration_scenario(base)
    pooled: dict[str, list[float]] = {k: [] for k in RUN_KEYS}
    for rep in range(reps):
        say(f"emulated run {rep + 1}/{reps}: {sc.total_nodes} workers at time scale {sc.emulation.time_scale:g}, "
            f"a node killed at step {KILL_AT}, the coordinator killed at step {COORDINATOR_AT}, "
            f"{sc.regions[-1].name} lost at step {RACK_AT}")
        for name, xs in run_samples(run_once(sc, work / f"run-{rep}", failures)).items():
            pooled[name] += xs
    return pooled


def calibrate(*, quick: bool = False, base: S.Scenario | None = None, workdir: str | Path | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Measure and fit; the object `calibration.json` holds."""
    from keel.paths import DEFAULT_SCENARIO
    base = base or S.load(DEFAULT_SCENARIO)
    from runtime.api import check_runnable
    check_runnable(base)
    started = time.perf_counter()

    def say(msg: str) -> None:
        if progress:
            print(f"calibrate: {msg} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)

    failures: list[dict[str, str]] = []
    reps = repetitions(quick)
    samples: dict[str, list[float]] = {}
    if base.policy.kind == "checkpoint_restart":
        # its every recovery is a relaunch, which the emulation (and the twin) time by
        # policy.restart_s: the runs measure none of the primitives (reform_s, spare_takeover_s,
        # coordinator_restart_s are absorb's re-forms), and cost minutes of relaunches
        say("nothing to measure under policy.kind checkpoint_restart: every recovery is a relaunch, timed by "
            "policy.restart_s; the twin takes every primitive from the scenario")
        reps = 0
    else:
        tmp = tempfile.TemporaryDirectory(prefix="keel-calibrate-") if workdir is None else None
        try:
            samples = measure(base, Path(tmp.name if tmp else workdir), reps, say, failures)
        finally:
            if tmp is not None:
                tmp.cleanup()
    fitted = fit_calibration(samples)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "reference": {**reference(base), "quick": quick, "runs": reps, "steps": STEPS},
        "duration_s": round(time.perf_counter() - started, 2),
        "missing": fitted["missing"],
        "runtime_failures": failures,
        "primitives": fitted["primitives"],
    }
