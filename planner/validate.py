"""`keel validate`: the twin's prediction against the runtime's observation, on one schedule.

The runtime runs the scenario as an emulated cluster (docs/emulation.md: one worker process
per node, the scenario's hardware, every mechanism real) `validate.repetitions` times. The
twin replays the same fault schedule (its stochastic fault rates switched off, so only
`faults.schedule` strikes), parameterised by the scenario and by a calibration of the runtime's
own recovery work measured separately (`keel calibrate`, at the same node count and time
scale), in `replicas` seeded replicas: the seeds vary only the twin's compute and link jitter.
The tolerances come from the scenario's `[validate]` table, fixed before anything runs, and a
repetition whose emulation was not faithful (too many late steps: the machine could not keep
the emulated time) makes the validation invalid, not a pass. Nothing is fitted to the runs
being judged. How predictions and observations are compared: planner/validate_compare.py.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from keel import calibration as K
from keel import scenario as S
from keel.errors import InputError, RunFailed
from keel.metrics import fault_episodes, goodput, since_fault_s
from keel.rundir import read_events, write_json
from planner import scenarios as PS
from planner.validate_compare import compare, table  # noqa: F401 (table: planner/cli.py)


# ----------------------------------------------------------------------------- calibration

def resolve_calibration(path: str | None, out_dir: Path, progress: bool, scenario: S.Scenario,
                        measure: Callable[..., dict] | None = None) -> tuple[dict, str, str]:
    """(calibration, its path, how it was found): the file given; else `calibration.json` in
    the output directory or the working directory, where it was measured for this emulated
    cluster; else measured now into the output directory."""
    if path:
        cal = K.load(path)
        check_reference(cal, scenario, str(path))
        return cal, str(path), "given"
    for candidate in (out_dir / K.FILENAME, Path(K.FILENAME)):
        if candidate.exists():
            cal = K.load(candidate)
            if reference_mismatch(cal, scenario) is None:
                return cal, str(candidate), "existing"
    target = out_dir / K.FILENAME
    if progress:
        print(f"validate: no calibration given or found for {scenario.run.name}; measuring one into {target}",
              file=sys.stderr)
    if measure is None:
        from planner.calibrate import calibrate as measure
    from planner.calibrate_fit import quick_from_env
    cal = measure(base=scenario, progress=progress, **({"quick": True} if quick_from_env() else {}))
    K.write(cal, target)
    return cal, str(target), "measured"


def reference_mismatch(calibration: Mapping[str, Any], scenario: S.Scenario) -> str | None:
    """Why a calibration does not hold for this emulated cluster (None where it does): its
    real recovery work, in emulated seconds, depends on the node count and the time scale."""
    from planner.calibrate import HOLDS_FOR, reference
    ref = calibration.get("reference") or {}
    here = reference(scenario)
    for key, value in ((k, here[k]) for k in HOLDS_FOR):
        if ref.get(key) != value:
            return f"key 'reference.{key}': measured at {ref.get(key)!r}, this scenario has {value!r}"
    return None


def check_reference(calibration: Mapping[str, Any], scenario: S.Scenario, source: str) -> None:
    why = reference_mismatch(calibration, scenario)
    if why is not None:
        raise InputError(f"{source}: {why}; expected a calibration of this emulated cluster "
                         f"(keel calibrate {scenario.source})")


# ----------------------------------------------------------------------------- the twin side

def twin_prediction(scenario: S.Scenario, calibration: Mapping[str, Any], replicas: int, out_dir: Path,
                    processes: int | None = None) -> dict[str, Any]:
    """The seeded reference run (written to out_dir/twin) and `replicas` jittered replicas."""
    import twin
    from keel.rundir import write_run
    from planner.replicas import LocalRunner, seeds_for, twin_summary
    replay = PS.schedule_only(scenario)
    result = twin.simulate(replay, seed=scenario.run.seed, calibration=dict(calibration))
    write_run(out_dir / "twin", result.events, result.summary)
    seeds = seeds_for(scenario.run.seed, replicas)
    with LocalRunner(twin_summary, processes) as runner:
        reps = runner.map([(replay, s, dict(calibration)) for s in seeds])
    return {"reference": result.summary, "replicas": reps, "seeds": seeds, "detect_s": detect_times(result.events)}


# ----------------------------------------------------------------------------- the runtime side

def detect_times(events: Sequence[Any]) -> dict[int, float]:
    """Per fault id: its first `detect` after its `fault` (seconds); absent where none came."""
    out = {}
    for ep in fault_episodes(events):
        detect = since_fault_s(ep, "detect")
        if detect is not None:
            out[ep["fault_id"]] = detect
    return out


def training_window(summary: Mapping[str, Any], events: Sequence[Any]) -> dict[str, Any]:
    """The runtime's wall time without the launch: its `run_start` comes before the worker
    processes are spawned (interpreters starting, torch importing, the first group forming),
    which the twin does not model. Training starts one fault-free step before the first commit."""
    start = next(e.t for e in events if e.kind == "run_start")
    first = next((e.t for e in events if e.kind == "step"), None)
    step = float(summary["step_time_s"])
    launch = max(0.0, (first - step) - start) if first is not None else 0.0
    wall = float(summary["wall_s"]) - launch
    return {"wall_s": wall, "goodput": goodput(summary["steps"], step, wall),
            "launch_s": launch, "wall_with_launch_s": float(summary["wall_s"]),
            "goodput_with_launch": float(summary["goodput"])}


def fresh(run_dir: Path) -> Path:
    """A run directory of validate's own, emptied: the runtime appends to an existing
    `events.jsonl`, and an earlier validation's run in the same place must not be read as
    part of this one's."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return run_dir


def observation(summary: Mapping[str, Any], events: Sequence[Any]) -> dict[str, Any]:
    """What a runtime repetition gives the comparison: its summary, training window and
    detections (bench/rejudge.py reads them from a repetition already on disk)."""
    return {**summary, **training_window(summary, events), "detect_s": detect_times(events)}


def observe(scenario: S.Scenario, rep_dir: Path, progress: bool) -> dict[str, Any]:
    """One runtime repetition into `rep_dir`: its `observation`."""
    from runtime.api import run_scenario
    summary = run_scenario(scenario, fresh(rep_dir), progress=progress)
    return observation(summary, read_events(rep_dir))


def runtime_observation(scenario: S.Scenario, repetitions: int, out_dir: Path,
                        progress: bool) -> list[dict[str, Any]]:
    """`repetitions` emulated runtime runs back to back."""
    observed = []
    for k in range(repetitions):
        rep_dir = out_dir / "runtime" / f"rep-{k}"
        if progress:
            print(f"validate: runtime repetition {k + 1}/{repetitions} -> {rep_dir}", file=sys.stderr)
        observed.append(observe(scenario, rep_dir, progress))
        emu = observed[-1].get("emulation") or {}
        if not emu.get("faithful", True):
            raise Unfaithful(unfaithful_line(scenario, k, repetitions, emu))
    return observed


class Unfaithful(RunFailed):
    """A repetition's emulation could not keep its time: its times are this machine's, not the
    cluster's, so the validation stops there and the twin is not judged (exit 1)."""


def unfaithful_line(scenario: S.Scenario, k: int, repetitions: int, emu: Mapping[str, Any]) -> str:
    from keel.capacity import ladder_up
    scale = float(emu.get("time_scale", scenario.emulation.time_scale))
    return (f"{scenario.source}: validation stopped after repetition {k + 1} of {repetitions}: its emulation was "
            f"not faithful ({emu.get('overruns')} of {emu.get('reports')} step reports late, limit "
            f"{100 * float(emu.get('max_overrun_fraction', 0)):g}%"
            + (f"; a relaunch {float(emu.get('relaunch_late_s', 0)):.3g} s past policy.restart_s"
               if emu.get("relaunch_overruns") else "")
            + "), so its times are this machine's, not the "
            f"cluster's, and the twin is not judged; a larger time scale keeps them (try --set "
            f"emulation.time_scale={ladder_up(2 * scale):g}, or \"auto\")")


def emulated(scenario: S.Scenario) -> S.Scenario:
    """The scenario as validation runs it: an emulated cluster, for `validate.steps` steps
    (where set), every scheduled fault striking before the last."""
    sc = scenario if scenario.emulation.enabled else scenario.with_overrides({"emulation.enabled": True})
    if sc.validate.steps:
        sc = sc.with_overrides({"run.steps": sc.validate.steps})
    late = [e for e in sc.faults.schedule if e.at_step >= sc.run.steps]
    if late:
        raise InputError(f"{scenario.source}: key 'faults.schedule': the fault at step {late[0].at_step} "
                         f"strikes after the validation's last step ({sc.run.steps}); expected every scheduled "
                         "fault before it (or a larger validate.steps)")
    return sc


def prepare(scenario: S.Scenario) -> S.Scenario:
    """The scenario as validation runs it (`emulated`), or InputError for what would stop the
    validation, before anything is measured or started."""
    if not scenario.faults.schedule:
        raise InputError(f"{scenario.source}: key 'faults.schedule': validation replays a fault schedule; "
                         "expected at least one [[faults.schedule]] entry")
    scenario = emulated(scenario)
    from runtime.api import check_runnable
    check_runnable(scenario)
    return scenario


def validate(scenario: S.Scenario, *, out_dir: str | Path, calibration: str | None = None,
             repetitions: int | None = None, replicas: int = 16, progress: bool = True,
             processes: int | None = None) -> dict[str, Any]:
    """Run (emulated), replay, compare; writes out_dir/comparison.json and returns it. A
    repetition whose emulation was not faithful stops it (`Unfaithful`): the twin is not judged."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scenario = prepare(scenario)  # before a calibration or any repetition starts
    if scenario.emulation.time_scale == "auto":
        from runtime.capacity import check_machine
        scenario = check_machine(scenario, "keel validate", progress)
    cal, cal_path, how = resolve_calibration(calibration, out, progress, scenario)
    if progress:
        print(f"validate: calibration {cal_path} ({how})", file=sys.stderr)
    n = repetitions or scenario.validate.repetitions
    observed = runtime_observation(scenario, n, out, progress)
    predicted = twin_prediction(scenario, cal, replicas, out, processes)
    comparison = compare(scenario, predicted, observed, cal_path, how)
    write_json(out / "comparison.json", comparison)
    return comparison


# ----------------------------------------------------------------------------- plan --validate

LOCAL_MAX_NODES = 16


def check_plan(scenario: S.Scenario, plan: Mapping[str, Any], out_dir: str | Path,
               progress: bool = True) -> dict[str, Any]:
    """Run the recommended policy and the baseline on the runtime with the scenario's fault
    schedule (stochastic rates off, as the runtime injects only the schedule) and check that
    the observed goodput ordering matches the predicted one."""
    from runtime.api import run_scenario
    if scenario.total_nodes > LOCAL_MAX_NODES:
        raise InputError(f"{scenario.source}: plan --validate runs both policies on the runtime here; "
                         f"expected a local scenario of at most {LOCAL_MAX_NODES} nodes (such as "
                         f"scenarios/local-8.toml), got {scenario.total_nodes} nodes")
    out = Path(out_dir)
    runs = {}
    for name in ("recommended", "baseline"):
        policy = {k: v for k, v in plan[name].items() if "." in k}
        sc = PS.with_policy(scenario, policy)
        if progress:
            print(f"plan --validate: running the {name} policy on the runtime -> {out / name}", file=sys.stderr)
        summary = run_scenario(sc, fresh(out / name), progress=progress)
        window = training_window(summary, read_events(out / name))
        runs[name] = {"policy": policy, "predicted_goodput": plan[name]["goodput"],
                      "observed_goodput": window["goodput"], "observed_wall_s": window["wall_s"],
                      "launch_s": window["launch_s"], "observed_goodput_with_launch": summary["goodput"],
                      "restarts": summary.get("restarts"), "out": str(out / name)}
    pred = runs["recommended"]["predicted_goodput"] - runs["baseline"]["predicted_goodput"]
    obs = runs["recommended"]["observed_goodput"] - runs["baseline"]["observed_goodput"]
    same = (pred > 0) == (obs > 0) or pred == obs == 0
    return {**runs, "predicted_order": "recommended" if pred > 0 else "baseline",
            "observed_order": "recommended" if obs > 0 else "baseline", "ordering_matches": same}
