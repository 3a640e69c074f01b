"""`keel validate`: the twin's prediction against the runtime's observation, on one schedule.

The runtime runs the scenario `validate.repetitions` times. The twin replays the same fault
schedule (its stochastic fault rates switched off, so only `faults.schedule` strikes),
parameterised by a calibration measured separately (`keel calibrate`), in `replicas` seeded
replicas: the seeds vary only the twin's compute and link jitter. The tolerances come from the
scenario's `[validate]` table, fixed before anything runs. Nothing is fitted to the runs
being judged. How predictions and observations are compared: planner/validate_compare.py.
"""
from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from keel import calibration as K
from keel import scenario as S
from keel.errors import InputError
from keel.metrics import fault_episodes, mean_step_s_after_warmup, since_fault_s
from keel.rundir import read_events, write_json
from planner import scenarios as PS
from planner.validate_compare import compare, table  # noqa: F401 (table: planner/cli.py)


# ----------------------------------------------------------------------------- calibration

def resolve_calibration(path: str | None, out_dir: Path, progress: bool,
                        measure: Callable[..., dict] | None = None) -> tuple[dict, str, str]:
    """(calibration, its path, how it was found): the file given; else `calibration.json` in
    the output directory or the working directory; else measured now into the output
    directory."""
    if path:
        return K.load(path), str(path), "given"
    for candidate in (out_dir / K.FILENAME, Path(K.FILENAME)):
        if candidate.exists():
            return K.load(candidate), str(candidate), "existing"
    target = out_dir / K.FILENAME
    if progress:
        print(f"validate: no calibration given or found; measuring one into {target}", file=sys.stderr)
    if measure is None:
        from planner.calibrate import calibrate as measure
    cal = measure(progress=progress)
    K.write(cal, target)
    return cal, str(target), "measured"


# ----------------------------------------------------------------------------- the twin side

def twin_prediction(scenario: S.Scenario, calibration: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                    replicas: int, out_dir: Path, processes: int | None = None) -> dict[str, Any]:
    """The seeded reference run (written to out_dir/twin) and `replicas` jittered replicas.
    Given several calibrations (one per repetition, each with the pace measured before it),
    replica i uses calibration i mod n, so the pooled replicas predict the repetitions."""
    import twin
    from keel.rundir import write_run
    from planner.replicas import LocalRunner, seeds_for, twin_summary
    cals = [dict(c) for c in calibration] if isinstance(calibration, (list, tuple)) else [dict(calibration)]
    replay = PS.schedule_only(scenario)
    result = twin.simulate(replay, seed=scenario.run.seed, calibration=cals[0])
    write_run(out_dir / "twin", result.events, result.summary)
    seeds = seeds_for(scenario.run.seed, replicas)
    with LocalRunner(twin_summary, processes) as runner:
        reps = runner.map([(replay, s, cals[i % len(cals)]) for i, s in enumerate(seeds)])
    return {"reference": result.summary, "replicas": reps, "seeds": seeds, "calibrations": len(cals),
            "detect_s": detect_times(result.events)}


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
    return {"wall_s": wall, "goodput": summary["steps"] * step / wall if wall > 0 else 0.0,
            "launch_s": launch, "wall_with_launch_s": float(summary["wall_s"]),
            "goodput_with_launch": float(summary["goodput"])}


def fresh(run_dir: Path) -> Path:
    """A run directory of validate's own, emptied: the runtime appends to an existing
    `events.jsonl`, and an earlier validation's run in the same place must not be read as
    part of this one's."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return run_dir


def observe(scenario: S.Scenario, rep_dir: Path, progress: bool) -> dict[str, Any]:
    """One runtime repetition into `rep_dir`: its summary, training window and detections."""
    from runtime.api import run_scenario
    summary = run_scenario(scenario, fresh(rep_dir), progress=progress)
    events = read_events(rep_dir)
    return {**summary, **training_window(summary, events), "detect_s": detect_times(events)}


def runtime_observation(scenario: S.Scenario, repetitions: int, out_dir: Path,
                        progress: bool) -> list[dict[str, Any]]:
    """`repetitions` runtime runs back to back (no pace runs between them)."""
    observed = []
    for k in range(repetitions):
        rep_dir = out_dir / "runtime" / f"rep-{k}"
        if progress:
            print(f"validate: runtime repetition {k + 1}/{repetitions} -> {rep_dir}", file=sys.stderr)
        observed.append(observe(scenario, rep_dir, progress))
    return observed


def pace_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> float:
    """How far the fault-free pace moved across a repetition: the relative change of the
    full membership's pace runs around it. (The fewest workers' runs, a shorter stretch of
    training, moved by up to 21 % between back-to-back runs where the full one moved 7 %:
    they would set aside runs for their own noise, not the machine's load.)"""
    return abs(after["step_time_s"] / before["step_time_s"] - 1.0)


def paced_observation(scenario: S.Scenario, repetitions: int, out_dir: Path, progress: bool,
                      measure_pace: Callable[[int], dict[str, Any]]) -> tuple[list, list, list, list]:
    """Repetitions bracketed by pace runs: pace 0, run, pace 1, run, pace 2, ... A run across
    which the pace moved by more than `validate.pace_steady_tol` ran under a load the pace runs
    do not describe; it is set aside (moved to `runtime/unsteady-J/`, recorded) and run again,
    `validate.reruns` times at most in all; past that it is judged and marked unsteady.

    Returns (observed, paces, brackets, set_aside): paces = the pace runs in order;
    brackets[k] = {before, after (indices into paces), change, steady} for judged repetition k."""
    tol, reruns = scenario.validate.pace_steady_tol, scenario.validate.reruns
    observed: list[dict] = []
    brackets: list[dict] = []
    set_aside: list[dict] = []
    for stale in (out_dir / "runtime").glob("unsteady-*"):  # an earlier validation's, here
        fresh(stale)
    paces = [measure_pace(0)]
    while len(observed) < repetitions:
        k = len(observed)
        rep_dir = out_dir / "runtime" / f"rep-{k}"
        if progress:
            print(f"validate: runtime repetition {k + 1}/{repetitions} -> {rep_dir}", file=sys.stderr)
        obs = observe(scenario, rep_dir, progress)
        paces.append(measure_pace(len(paces)))
        before, after = len(paces) - 2, len(paces) - 1
        change = pace_change(paces[before], paces[after])
        steady = change <= tol
        if not steady and len(set_aside) < reruns:
            moved = out_dir / "runtime" / f"unsteady-{len(set_aside)}"  # the stale ones are gone
            rep_dir.rename(moved)
            set_aside.append({"dir": str(moved), "pace_before": before, "pace_after": after, "change": change,
                              "wall_s": obs["wall_s"]})
            if progress:
                print(f"validate: the fault-free pace moved {change:.0%} across that run (tolerance {tol:.0%}): "
                      f"set aside in {moved}, running it again", file=sys.stderr)
            continue
        observed.append(obs)
        brackets.append({"before": before, "after": after, "change": change, "steady": steady})
    return observed, paces, brackets, set_aside


PACED = ("reduce_latency_s", "reduce_gbyte_s", "step_overhead_s", "host_pace_per_worker")  # what a pace run re-measures


def fewest_workers(scenario: S.Scenario, calibration: Mapping[str, Any]) -> int:
    """The fewest nodes holding slots in the twin's replay of the schedule: the smallest
    membership a judged run trains with (once the kills have used up the hot spares, with a
    straggler parked), whose fault-free pace differs from the full one's where the workers
    share a machine's cores."""
    import twin
    return twin.fewest_holders(PS.schedule_only(scenario), calibration, scenario.run.seed)


def pace_run(scenario: S.Scenario, out_dir: Path, progress: bool, name: str = "pace",
             workers: int | None = None) -> float:
    """The fault-free step time of the scenario now (its own run directory, not one of the
    judged runs), with `workers` training workers where given: the same nodes and slots, the
    others idle as hot spares. The run's mean step past its first two
    (`keel.metrics.mean_step_s_after_warmup`), as calibrate's pace runs measure it."""
    from planner.calibrate import PACE_STEPS
    from runtime.api import run_scenario
    sc = scenario
    if workers is not None and workers != scenario.training_nodes:
        sc = scenario.with_overrides({"policy.hot_spares": scenario.total_nodes - workers})
    pace_dir = out_dir / "runtime" / name
    if progress:
        print(f"validate: a fault-free pace run with {sc.training_nodes} workers -> {pace_dir}", file=sys.stderr)
    run_scenario(sc, fresh(pace_dir), steps=min(scenario.run.steps, PACE_STEPS), no_faults=True, progress=progress)
    return mean_step_s_after_warmup(read_events(pace_dir))


def paced_calibrations(scenario: S.Scenario, calibration: Mapping[str, Any],
                       paces: Sequence[Mapping[str, Any]], brackets: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One calibration per repetition, its load-dependent pace re-measured
    (`planner.calibrate_fit.refresh_pace`): a repetition is bracketed by the pace runs before and
    after it, so it takes their mean (a drift of the machine's load over the repetition
    cancels to first order); every other primitive is the calibration's."""
    from planner.calibrate_fit import refresh_pace
    out = []
    for b in brackets:
        before, after = paces[b["before"]], paces[b["after"]]
        step = (before["step_time_s"] + after["step_time_s"]) / 2
        fewer = None
        if before.get("fewer_step_time_s") is not None:
            fewer = (before["fewer_workers"], (before["fewer_step_time_s"] + after["fewer_step_time_s"]) / 2)
        out.append(refresh_pace(calibration, scenario, step,
                                f"fault-free pace runs {before['dir']} and {after['dir']}", fewer))
    return out


LOAD_DRIFT_WARN = 0.15


def load_drift(calibration: Mapping[str, Any], scenario: S.Scenario,
               paces: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How busy the machine was when the calibration was measured against now: its fault-free
    pace at this membership against the pace runs'. The recovery primitives (detection,
    re-formation, take-over) are the calibration's and slow down with the load like a step
    does; where the paces differ by more than LOAD_DRIFT_WARN the comparison says so."""
    by_workers = (calibration.get("pace") or {}).get("step_time_s_by_workers") or {}
    then = by_workers.get(str(scenario.training_nodes))
    if then is None or not paces:
        return None
    now = statistics.median(p["step_time_s"] for p in paces)
    drift = now / then - 1.0
    return {"calibration_step_s": then, "validation_step_s": now, "drift": drift,
            "warn": abs(drift) > LOAD_DRIFT_WARN}


def validate(scenario: S.Scenario, *, out_dir: str | Path, calibration: str | None = None,
             repetitions: int | None = None, replicas: int = 16, progress: bool = True,
             processes: int | None = None, refresh_pace: bool = True) -> dict[str, Any]:
    """Run, replay, compare; writes out_dir/comparison.json and returns it.

    The fault-free pace depends on how busy the machine is now, not only on what it is: with
    `refresh_pace`, fault-free runs before the first repetition and after each one (with the
    full membership, and with the fewest workers the schedule leaves where that differs)
    re-measure it for the twin, and a repetition across which it moved is run again
    (`paced_observation`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not scenario.faults.schedule:
        raise InputError(f"{scenario.source}: key 'faults.schedule': validation replays a fault schedule; "
                         "expected at least one [[faults.schedule]] entry")
    cal, cal_path, how = resolve_calibration(calibration, out, progress)
    if progress:
        print(f"validate: calibration {cal_path} ({how})", file=sys.stderr)
    fewer = fewest_workers(scenario, cal)

    def measure_pace(k: int) -> dict[str, Any]:
        pace: dict[str, Any] = {"dir": str(out / "runtime" / f"pace-{k}"), "workers": scenario.training_nodes,
                                "step_time_s": pace_run(scenario, out, progress, f"pace-{k}")}
        if fewer != scenario.training_nodes:
            pace["fewer_workers"] = fewer
            pace["fewer_step_time_s"] = pace_run(scenario, out, progress, f"pace-{k}-{fewer}w", fewer)
        return pace

    n = repetitions or scenario.validate.repetitions
    if refresh_pace:
        observed, paces, brackets, set_aside = paced_observation(scenario, n, out, progress, measure_pace)
        paced = paced_calibrations(scenario, cal, paces, brackets)
    else:
        observed, paces, brackets, set_aside = runtime_observation(scenario, n, out, progress), [], [], []
        paced = [cal]
    predicted = twin_prediction(scenario, paced, replicas, out, processes)
    comparison = compare(scenario, predicted, observed, cal_path, how)
    comparison["pace_runs"] = paces
    comparison["pace_brackets"] = brackets
    comparison["set_aside"] = set_aside
    comparison["steady"] = all(b["steady"] for b in brackets)
    comparison["calibration_load"] = load_drift(cal, scenario, paces)
    comparison["paced_primitives"] = [{k: c["primitives"][k]["median"] for k in PACED if k in c["primitives"]}
                                      for c in paced] if refresh_pace else []
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
