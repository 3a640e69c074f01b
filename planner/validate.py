"""`keel validate`: the twin's prediction against the runtime's observation, on one schedule.

The runtime runs the scenario `validate.repetitions` times. The twin replays the same fault
schedule (its stochastic fault rates switched off, so only `faults.schedule` strikes),
parameterised by a calibration measured separately (`keel calibrate`), in `replicas` seeded
replicas: the seeds vary only the twin's compute and link jitter. The tolerances come from the
scenario's `[validate]` table, fixed before anything runs. Nothing is fitted to the runs
being judged.

Per fault: observed = the median over the runtime's repetitions, with every repetition's
value; predicted = the same statistic of the twin's predictions of the repetitions (each
repetition is predicted by the mean of the replicas run with its own paced calibration; the
median over repetitions of those), with the 2.5-97.5 % range of all replicas as `*_ci95`.
Relative error = |predicted - observed| / observed.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from keel import scenario as S
from keel.errors import InputError, RunFailed
from planner import scenarios as PS


def rel_err(predicted: float, observed: float) -> float:
    if observed == 0:
        return abs(predicted - observed)
    return abs(predicted - observed) / abs(observed)


def interval(xs: Sequence[float]) -> list[float]:
    """The 2.5 % and 97.5 % points of the replicas (linear interpolation)."""
    ys = sorted(xs)
    if len(ys) == 1:
        return [ys[0], ys[0]]

    def q(p: float) -> float:
        k = p * (len(ys) - 1)
        i = int(k)
        return ys[i] if i + 1 >= len(ys) else ys[i] + (ys[i + 1] - ys[i]) * (k - i)
    return [q(0.025), q(0.975)]


# ----------------------------------------------------------------------------- calibration

def resolve_calibration(path: str | None, out_dir: Path, progress: bool,
                        measure: Callable[..., dict] | None = None) -> tuple[dict, str, str]:
    """(calibration, its path, how it was found): the file given; else `calibration.json` in
    the output directory or the working directory; else measured now into the output
    directory."""
    from twin.params import load_calibration
    if path:
        return load_calibration(path), str(path), "given"
    for candidate in (out_dir / "calibration.json", Path("calibration.json")):
        if candidate.exists():
            return load_calibration(candidate), str(candidate), "existing"
    from planner import calibrate as C
    target = out_dir / "calibration.json"
    if progress:
        print(f"validate: no calibration given or found; measuring one into {target}", file=sys.stderr)
    cal = (measure or C.calibrate)(progress=progress)
    C.write(cal, target)
    return cal, str(target), "measured"


# ----------------------------------------------------------------------------- the twin side

def twin_prediction(scenario: S.Scenario, calibration: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                    replicas: int, out_dir: Path, processes: int | None = None) -> dict[str, Any]:
    """The seeded reference run (written to out_dir/twin) and `replicas` jittered replicas.
    Given several calibrations (one per repetition, each with the pace measured before it),
    replica i uses calibration i mod n, so the pooled replicas predict the repetitions."""
    import twin
    from keel.events import write_events
    from planner.replicas import LocalRunner, seeds_for
    cals = [dict(c) for c in calibration] if isinstance(calibration, (list, tuple)) else [dict(calibration)]
    replay = PS.schedule_only(scenario)
    result = twin.simulate(replay, seed=scenario.run.seed, calibration=cals[0])
    twin_dir = out_dir / "twin"
    twin_dir.mkdir(parents=True, exist_ok=True)
    events_path = twin_dir / "events.jsonl"
    if events_path.exists():
        events_path.unlink()
    write_events(events_path, _as_events(result.events))
    (twin_dir / "summary.json").write_text(json.dumps(result.summary, indent=1, sort_keys=True, default=str) + "\n")
    seeds = seeds_for(scenario.run.seed, replicas)
    with LocalRunner(processes) as runner:
        reps = runner.map([(replay, s, cals[i % len(cals)]) for i, s in enumerate(seeds)])
    return {"reference": result.summary, "replicas": reps, "seeds": seeds, "calibrations": len(cals),
            "detect_s": detect_times(_as_events(result.events))}


def _as_events(events: Sequence[Any]) -> list[Any]:
    from keel.events import Event, validate_event
    return [e if isinstance(e, Event) else validate_event(e) for e in events]


# ----------------------------------------------------------------------------- the runtime side

def detect_times(events: Sequence[Any]) -> dict[int, float]:
    """Per fault id: its first `detect` after its `fault` (seconds); absent where none came."""
    fault_t: dict[int, float] = {}
    out: dict[int, float] = {}
    for e in events:
        fid = e.detail.get("fault_id")
        if fid is None:
            continue
        if e.kind == "fault":
            fault_t[fid] = e.t
        elif e.kind == "detect" and fid in fault_t and fid not in out:
            out[fid] = e.t - fault_t[fid]
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
    from keel.events import read_events
    from runtime.api import run_scenario
    summary = run_scenario(scenario, fresh(rep_dir), progress=progress)
    events = read_events(rep_dir / "events.jsonl")
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


# ----------------------------------------------------------------------------- comparing

def _match(faults: Sequence[Mapping[str, Any]], ref: Mapping[str, Any]) -> Mapping[str, Any] | None:
    same = [f for f in faults if f.get("fault_id") == ref.get("fault_id")
            and f.get("class") == ref.get("class")]
    if same:
        return same[0]
    same = [f for f in faults if f.get("class") == ref.get("class") and f.get("target") == ref.get("target")]
    return same[0] if same else None


def repetition_means(values: Sequence[float | None], repetitions: int) -> list[float]:
    """Each repetition's predicted value: replica i was run with repetition i mod
    `repetitions`'s calibration, and a repetition's prediction is the mean of its replicas."""
    groups = [[v for v in values[k::repetitions] if v is not None] for k in range(repetitions)]
    return [statistics.fmean(g) for g in groups if g]


def per_repetition(values: Sequence[float | None], repetitions: int) -> float:
    """The median over repetitions of each one's predicted value (`repetition_means`). A load
    spike during one repetition moves its prediction as it moves that repetition, so the
    predicted statistic matches the observed median, not a mean that the spike would pull."""
    return statistics.median(repetition_means(values, repetitions))


def compare(scenario: S.Scenario, predicted: Mapping[str, Any], observed: Sequence[Mapping[str, Any]],
            calibration_path: str, calibration_how: str) -> dict[str, Any]:
    tol = scenario.validate
    reps = predicted["replicas"]
    n_cal = predicted.get("calibrations", 1)
    ref = predicted["reference"]
    central = lambda values: per_repetition(values, n_cal)  # noqa: E731
    faults = []
    for f in ref.get("faults", []):
        matched = [_match(r["faults"], f) for r in reps]
        pred_d = [m["downtime_s"] for m in matched if m]
        pred_c = [m["cost_s"] for m in matched if m]
        obs = [m for m in (_match(o.get("faults", []), f) for o in observed) if m]
        obs_d = [m["downtime_s"] for m in obs]
        obs_c = [m["cost_s"] for m in obs]
        if not obs or not pred_d:
            raise RunFailed(f"fault {f.get('fault_id')} ({f.get('class')} on {f.get('target')}) was predicted "
                            f"but {'not observed' if not obs else 'missing in the replicas'}")
        p = {"downtime_s": central([m and m["downtime_s"] for m in matched]),
             "cost_s": central([m and m["cost_s"] for m in matched]),
             "downtime_ci95": interval(pred_d), "cost_ci95": interval(pred_c),
             "detect_s": predicted.get("detect_s", {}).get(f.get("fault_id"))}
        o = {"downtime_s": statistics.median(obs_d), "cost_s": statistics.median(obs_c),
             "downtime_s_reps": obs_d, "cost_s_reps": obs_c,
             "detect_s_reps": [od.get("detect_s", {}).get(m.get("fault_id")) for od, m in
                               ((od, _match(od.get("faults", []), f)) for od in observed) if m],
             "actions": sorted({m.get("action") or "" for m in obs})}
        faults.append({"fault_id": f.get("fault_id"), "class": f.get("class"), "target": f.get("target"),
                       "action": f.get("action"), "at_step": f.get("at_step"),
                       "predicted": p, "observed": o,
                       "downtime_rel_err": rel_err(p["downtime_s"], o["downtime_s"]),
                       "cost_rel_err": rel_err(p["cost_s"], o["cost_s"])})
    observed_faults = {(m.get("class"), m.get("target")) for o in observed for m in o.get("faults", [])}
    unpredicted = sorted(observed_faults - {(f["class"], f["target"]) for f in faults}, key=str)
    wall_pred = [r["wall_s"] for r in reps]
    wall_obs = [o["wall_s"] for o in observed]
    good_pred = [r["goodput"] for r in reps]
    good_obs = [o["goodput"] for o in observed]
    wall = {"predicted": central(wall_pred), "observed": statistics.median(wall_obs),
            "observed_reps": wall_obs, "predicted_ci95": interval(wall_pred),
            "predicted_reps": repetition_means(wall_pred, n_cal) if n_cal == len(observed) else None,
            "launch_s_reps": [o.get("launch_s") for o in observed],
            "note": "training wall time: the runtime's launch (run_start to one step before the first commit) excluded"}
    wall["rel_err_of_medians"] = rel_err(wall["predicted"], wall["observed"])
    wall["rel_err"] = wall["rel_err_of_medians"]
    if wall["predicted_reps"] and all(o > 0 for o in wall_obs):
        # each repetition has its own prediction (from the pace runs around it): the error is
        # the typical repetition's, |median of (predicted - observed) / observed|, paired
        wall["rel_err_reps"] = [(p - o) / o for p, o in zip(wall["predicted_reps"], wall_obs)]
        wall["rel_err"] = abs(statistics.median(wall["rel_err_reps"]))
    goodput = {"predicted": central(good_pred), "observed": statistics.median(good_obs),
               "observed_reps": good_obs, "predicted_ci95": interval(good_pred)}
    goodput["rel_err"] = rel_err(goodput["predicted"], goodput["observed"])
    step = {"predicted": central([r["step_time_s"] for r in reps]),
            "observed": statistics.median(o["step_time_s"] for o in observed)}
    step["rel_err"] = rel_err(step["predicted"], step["observed"])
    median_err = statistics.median(f["downtime_rel_err"] for f in faults) if faults else 0.0
    by_class: dict[str, list[float]] = {}
    for f in faults:
        by_class.setdefault(f["class"], []).append(f["downtime_rel_err"])
    ok_down = median_err <= tol.downtime_rel_tol
    ok_wall = wall["rel_err"] <= tol.wall_rel_tol
    return {
        "scenario": scenario.run.name,
        "config_hash": scenario.config_hash(),
        "calibration": calibration_path,
        "calibration_source": calibration_how,
        "repetitions": len(observed),
        "twin_replicas": len(reps),
        "twin_seeds": predicted["seeds"],
        "tolerances": {"downtime_rel_tol": tol.downtime_rel_tol, "wall_rel_tol": tol.wall_rel_tol,
                       "pace_steady_tol": tol.pace_steady_tol},
        "faults": faults,
        "unpredicted_faults": [list(x) for x in unpredicted],
        "wall_s": wall,
        "goodput": goodput,
        "step_time_s": step,
        "restarts": {"predicted": statistics.fmean(r.get("restarts") or 0 for r in reps),
                     "observed": [o.get("restarts") for o in observed]},
        "downtime_median_rel_err": median_err,
        "downtime_rel_err_by_class": {k: statistics.median(v) for k, v in by_class.items()},
        "pass": {"downtime": ok_down, "wall": ok_wall, "all": ok_down and ok_wall},
    }


PACED = ("reduce_latency_s", "reduce_gbyte_s", "step_overhead_s", "host_pace_per_worker")  # what a pace run re-measures


def fewest_workers(scenario: S.Scenario, calibration: Mapping[str, Any]) -> int:
    """The fewest nodes holding slots in the twin's replay of the schedule: the smallest
    membership a judged run trains with (once the kills have used up the hot spares, with a
    straggler parked), whose fault-free pace differs from the full one's where the workers
    share a machine's cores."""
    from twin.model import Simulation
    from twin.params import TwinParams
    replay = PS.schedule_only(scenario)
    sim = Simulation(replay, TwinParams.from_scenario(replay, calibration), scenario.run.seed)
    sim.run()
    return min(sim.memberships)


def pace_run(scenario: S.Scenario, out_dir: Path, progress: bool, name: str = "pace",
             workers: int | None = None) -> float:
    """The fault-free step time of the scenario now (its own run directory, not one of the
    judged runs), with `workers` training workers where given: the same nodes and slots, the
    others idle as hot spares."""
    from keel.events import read_events
    from planner.calibrate import PACE_STEPS, throughput_step_s
    from runtime.api import run_scenario
    sc = scenario
    if workers is not None and workers != scenario.training_nodes:
        raw = PS.plain(scenario)
        raw["policy"]["hot_spares"] = scenario.total_nodes - workers
        sc = S.from_dict(raw, scenario.source)
    pace_dir = out_dir / "runtime" / name
    if progress:
        print(f"validate: a fault-free pace run with {sc.training_nodes} workers -> {pace_dir}", file=sys.stderr)
    run_scenario(sc, fresh(pace_dir), steps=min(scenario.run.steps, PACE_STEPS), no_faults=True, progress=progress)
    return throughput_step_s(read_events(pace_dir / "events.jsonl"))


def paced_calibrations(scenario: S.Scenario, calibration: Mapping[str, Any],
                       paces: Sequence[Mapping[str, Any]], brackets: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One calibration per repetition, its load-dependent pace re-measured
    (`planner.calibrate.refresh_pace`): a repetition is bracketed by the pace runs before and
    after it, so it takes their mean (a drift of the machine's load over the repetition
    cancels to first order); every other primitive is the calibration's."""
    from planner.calibrate import refresh_pace
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
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1, sort_keys=True, allow_nan=False) + "\n")
    return comparison


# ----------------------------------------------------------------------------- printing

def _median(xs: Sequence[float | None] | None) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) if xs else None


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def table(c: Mapping[str, Any]) -> str:
    tol = c["tolerances"]
    lines = [f"validate {c['scenario']}: {c['repetitions']} runtime repetitions vs {c['twin_replicas']} twin "
             f"replicas; calibration {c['calibration']} ({c['calibration_source']})",
             f"{'fault':<5} {'class':<21} {'target':<14} {'action':<24} {'downtime pred':>13} {'obs':>7} "
             f"{'err':>6}   {'cost pred':>9} {'obs':>7} {'err':>6}   {'detect pred':>11} {'obs':>7}"]
    for f in c["faults"]:
        p, o = f["predicted"], f["observed"]
        lines.append(f"{f['fault_id']!s:<5} {f['class']:<21} {f['target']!s:<14} {f['action']!s:<24} "
                     f"{p['downtime_s']:>12.3f}s {o['downtime_s']:>6.3f}s {f['downtime_rel_err']:>6.1%}   "
                     f"{p['cost_s']:>8.3f}s {o['cost_s']:>6.3f}s {f['cost_rel_err']:>6.1%}   "
                     f"{_secs(p.get('detect_s')):>11} {_secs(_median(o.get('detect_s_reps'))):>7}")
    w, g = c["wall_s"], c["goodput"]
    ok = lambda b: "pass" if b else "FAIL"  # noqa: E731
    lines += [
        f"wall time: predicted {w['predicted']:.2f} s [{w['predicted_ci95'][0]:.2f}, {w['predicted_ci95'][1]:.2f}], "
        f"observed {w['observed']:.2f} s (reps {', '.join(f'{x:.2f}' for x in w['observed_reps'])}), "
        f"error {w['rel_err']:.1%} (tolerance {tol['wall_rel_tol']:.0%}): {ok(c['pass']['wall'])}",
        *([f"  each repetition against its own prediction: "
           f"{', '.join(f'{x:+.1%}' for x in w['rel_err_reps'])}; the medians' error {w['rel_err_of_medians']:.1%}"]
          if w.get("rel_err_reps") else []),
        f"goodput: predicted {g['predicted']:.3f}, observed {g['observed']:.3f}, error {g['rel_err']:.1%}",
        f"per-fault downtime: median error {c['downtime_median_rel_err']:.1%} "
        f"(tolerance {tol['downtime_rel_tol']:.0%}): {ok(c['pass']['downtime'])}",
        f"result: {'PASS' if c['pass']['all'] else 'FAIL'}",
    ]
    for a in c.get("set_aside", []):
        lines.append(f"set aside and run again: {a['dir']} (the fault-free pace moved {a['change']:.0%} across it, "
                     f"tolerance {tol.get('pace_steady_tol', 0):.0%})")
    unsteady = [k for k, b in enumerate(c.get("pace_brackets", [])) if not b["steady"]]
    if unsteady:
        lines.append(f"warning: repetition(s) {', '.join(str(k) for k in unsteady)} judged although the fault-free pace "
                     f"moved more than {tol.get('pace_steady_tol', 0):.0%} across them (no reruns left): the machine's "
                     "load was not steady, the verdict says more about it than about the twin")
    drift = c.get("calibration_load")
    if drift and drift["warn"]:
        lines.append(f"warning: the calibration was measured at a fault-free step of {drift['calibration_step_s']:.3f} s, "
                     f"this validation at {drift['validation_step_s']:.3f} s ({drift['drift']:+.0%}): the machine's load "
                     "changed, and the calibrated recovery times with it; calibrate again under this load")
    return "\n".join(lines)


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
        from keel.events import read_events
        window = training_window(summary, read_events(out / name / "events.jsonl"))
        runs[name] = {"policy": policy, "predicted_goodput": plan[name]["goodput"],
                      "observed_goodput": window["goodput"], "observed_wall_s": window["wall_s"],
                      "launch_s": window["launch_s"], "observed_goodput_with_launch": summary["goodput"],
                      "restarts": summary.get("restarts"), "out": str(out / name)}
    pred = runs["recommended"]["predicted_goodput"] - runs["baseline"]["predicted_goodput"]
    obs = runs["recommended"]["observed_goodput"] - runs["baseline"]["observed_goodput"]
    same = (pred > 0) == (obs > 0) or pred == obs == 0
    return {**runs, "predicted_order": "recommended" if pred > 0 else "baseline",
            "observed_order": "recommended" if obs > 0 else "baseline", "ordering_matches": same}
