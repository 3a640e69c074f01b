"""validate's verdict: the twin's predictions against the runtime's observations
(`compare`, the object `comparison.json` holds) and its table for a terminal (`table`).
Pure functions of the summaries; planner/validate.py runs what they compare.

Per fault: observed = the median over the runtime's repetitions, with every repetition's
value; predicted = the mean of the twin's replicas, with their 2.5-97.5 % range as `*_ci95`
(`keel.stats.range95`). Relative error = |predicted - observed| / observed. The verdict: the
median per-fault downtime error, every fault's error and the wall time's within the
scenario's `[validate]` tolerances, and every repetition a faithful emulation.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

from keel import scenario as S
from keel.errors import RunFailed
from keel.stats import range95


def rel_err(predicted: float, observed: float) -> float:
    if observed == 0:
        return abs(predicted - observed)
    return abs(predicted - observed) / abs(observed)


def _match(faults: Sequence[Mapping[str, Any]], ref: Mapping[str, Any]) -> Mapping[str, Any] | None:
    same = [f for f in faults if f.get("fault_id") == ref.get("fault_id")
            and f.get("class") == ref.get("class")]
    if same:
        return same[0]
    same = [f for f in faults if f.get("class") == ref.get("class") and f.get("target") == ref.get("target")]
    return same[0] if same else None


def _fault(f: Mapping[str, Any], reps: Sequence[Mapping[str, Any]], observed: Sequence[Mapping[str, Any]],
           predicted: Mapping[str, Any], central: Callable[[Sequence], float]) -> dict[str, Any]:
    """One predicted fault against its observations (matched by id and class, else class and
    target)."""
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
         "downtime_ci95": range95(pred_d), "cost_ci95": range95(pred_c),
         "detect_s": predicted.get("detect_s", {}).get(f.get("fault_id"))}
    o = {"downtime_s": statistics.median(obs_d), "cost_s": statistics.median(obs_c),
         "downtime_s_reps": obs_d, "cost_s_reps": obs_c,
         "detect_s_reps": [od.get("detect_s", {}).get(m.get("fault_id")) for od, m in
                           ((od, _match(od.get("faults", []), f)) for od in observed) if m],
         "actions": sorted({m.get("action") or "" for m in obs})}
    return {"fault_id": f.get("fault_id"), "class": f.get("class"), "target": f.get("target"),
            "action": f.get("action"), "at_step": f.get("at_step"),
            "predicted": p, "observed": o,
            "downtime_rel_err": rel_err(p["downtime_s"], o["downtime_s"]),
            "cost_rel_err": rel_err(p["cost_s"], o["cost_s"])}


def _wall(reps: Sequence[Mapping[str, Any]], observed: Sequence[Mapping[str, Any]],
          central: Callable[[Sequence], float]) -> dict[str, Any]:
    wall_pred = [r["wall_s"] for r in reps]
    wall_obs = [o["wall_s"] for o in observed]
    wall = {"predicted": central(wall_pred), "observed": statistics.median(wall_obs),
            "observed_reps": wall_obs, "predicted_ci95": range95(wall_pred),
            "launch_s_reps": [o.get("launch_s") for o in observed],
            "note": "training wall time: the runtime's launch (run_start to one step before the first commit) excluded"}
    wall["rel_err"] = rel_err(wall["predicted"], wall["observed"])
    return wall


def compare(scenario: S.Scenario, predicted: Mapping[str, Any], observed: Sequence[Mapping[str, Any]],
            calibration_path: str, calibration_how: str) -> dict[str, Any]:
    tol = scenario.validate
    reps = predicted["replicas"]

    def central(values: Sequence[float | None]) -> float:
        return statistics.fmean(v for v in values if v is not None)
    faults = [_fault(f, reps, observed, predicted, central) for f in predicted["reference"].get("faults", [])]
    observed_faults = {(m.get("class"), m.get("target")) for o in observed for m in o.get("faults", [])}
    unpredicted = sorted(observed_faults - {(f["class"], f["target"]) for f in faults}, key=str)
    wall = _wall(reps, observed, central)
    good_pred = [r["goodput"] for r in reps]
    goodput = {"predicted": central(good_pred), "observed": statistics.median(o["goodput"] for o in observed),
               "observed_reps": [o["goodput"] for o in observed], "predicted_ci95": range95(good_pred)}
    goodput["rel_err"] = rel_err(goodput["predicted"], goodput["observed"])
    step = {"predicted": central([r["step_time_s"] for r in reps]),
            "observed": statistics.median(o["step_time_s"] for o in observed)}
    step["rel_err"] = rel_err(step["predicted"], step["observed"])
    median_err = statistics.median(f["downtime_rel_err"] for f in faults) if faults else 0.0
    by_class: dict[str, list[float]] = {}
    for f in faults:
        by_class.setdefault(f["class"], []).append(f["downtime_rel_err"])
    ok_down = median_err <= tol.downtime_rel_tol
    ok_each = all(f["downtime_rel_err"] <= tol.fault_rel_tol for f in faults)
    ok_wall = wall["rel_err"] <= tol.wall_rel_tol
    emulation = [o.get("emulation") for o in observed]
    faithful = all(e is None or e.get("faithful", False) for e in emulation)
    return {
        "scenario": scenario.run.name, "config_hash": scenario.config_hash(),
        "calibration": calibration_path, "calibration_source": calibration_how,
        "repetitions": len(observed), "twin_replicas": len(reps), "twin_seeds": predicted["seeds"],
        "tolerances": {"downtime_rel_tol": tol.downtime_rel_tol, "fault_rel_tol": tol.fault_rel_tol,
                       "wall_rel_tol": tol.wall_rel_tol},
        "emulation": emulation,
        "faults": faults,
        "unpredicted_faults": [list(x) for x in unpredicted],
        "wall_s": wall, "goodput": goodput, "step_time_s": step,
        "restarts": {"predicted": statistics.fmean(r.get("restarts") or 0 for r in reps),
                     "observed": [o.get("restarts") for o in observed]},
        "downtime_median_rel_err": median_err,
        "downtime_rel_err_by_class": {k: statistics.median(v) for k, v in by_class.items()},
        # an emulation that could not keep its time makes the validation invalid, not a pass
        "pass": {"downtime": ok_down, "each_fault": ok_each, "wall": ok_wall, "valid": faithful,
                 "all": ok_down and ok_each and ok_wall and faithful},
    }


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
        f"goodput: predicted {g['predicted']:.3f}, observed {g['observed']:.3f}, error {g['rel_err']:.1%}",
        f"per-fault downtime: median error {c['downtime_median_rel_err']:.1%} "
        f"(tolerance {tol['downtime_rel_tol']:.0%}): {ok(c['pass']['downtime'])}",
        f"result: {'PASS' if c['pass']['all'] else 'FAIL'}",
    ]
    worst = max((f["downtime_rel_err"] for f in c["faults"]), default=0.0)
    lines.insert(-1, f"every fault's downtime: largest error {worst:.1%} (tolerance "
                     f"{tol.get('fault_rel_tol', 0):.0%}): {ok(c['pass'].get('each_fault', True))}")
    emu = [e for e in c.get("emulation") or [] if e]
    if emu:
        late = sum(e["overruns"] for e in emu)
        reports = sum(e["reports"] for e in emu)
        lines.insert(-1, f"emulation: {late} of {reports} step reports late over {len(emu)} repetitions "
                         f"(at most {emu[0]['max_overrun_fraction']:.0%} each): "
                         f"{'faithful' if c['pass'].get('valid', True) else 'NOT faithful: the validation is invalid'}")
    return "\n".join(lines)
