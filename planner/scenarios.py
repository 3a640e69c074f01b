"""Scenario variants the planner needs: a candidate policy applied to a scenario, the
stochastic fault rates switched off, and the closed forms (job MTBF, checkpoint write time,
Young/Daly's interval) taken from a scenario's figures.

A candidate's `policy.hot_spares` adds (or removes) nodes at the end of the last region: the
training nodes stay as the scenario has them, so spares are extra nodes that are paid for.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from keel import fault_classes as FC
from keel import scenario as S
from keel.errors import InputError

SPARES_KEY = "policy.hot_spares"


def with_policy(scenario: S.Scenario, policy: Mapping[str, Any]) -> S.Scenario:
    """The scenario with the dotted keys of `policy` set. `policy.hot_spares` keeps the
    training nodes fixed and resizes the last region instead (the spares are its last nodes):
    a later key of `policy` naming that region's `nodes` still wins, as any later key does."""
    values: dict[str, Any] = {}
    for key, value in policy.items():
        if key == SPARES_KEY:
            delta = int(value) - scenario.policy.hot_spares
            values[f"regions.{len(scenario.regions) - 1}.nodes"] = scenario.regions[-1].nodes + delta
        values[key] = value
    return scenario.with_overrides(values)


def spares_range(scenario: S.Scenario, extra: int = 4) -> tuple[int, int]:
    """The hot-spare counts a candidate may have: from the fewest the scenario still accepts
    (its scheduled faults must keep their targets) to `extra` more than it has."""
    base = scenario.policy.hot_spares
    low = base
    for k in range(0, base + 1):
        try:
            with_policy(scenario, {SPARES_KEY: k})
        except InputError:
            continue
        low = k
        break
    return low, base + extra


def schedule_only(scenario: S.Scenario) -> S.Scenario:
    """The scenario with every stochastic fault rate at 0: only `faults.schedule` strikes."""
    return scenario.with_overrides(FC.rate_overrides(0.0))


def paid_nodes(scenario: S.Scenario) -> int:
    """Every node is paid for, spares included."""
    return scenario.total_nodes


def primitive(calibration: Mapping[str, Any] | None, name: str) -> float | None:
    if not calibration:
        return None
    entry = calibration.get("primitives", {}).get(name)
    return float(entry["median"]) if entry else None


def checkpoint_write_s(scenario: S.Scenario, calibration: Mapping[str, Any] | None = None) -> float:
    """Wall time of one checkpoint write: its bytes spread evenly over the training nodes,
    each writing its share at the per-node bandwidth (the calibrated one where given)."""
    c = scenario.checkpoint
    bw = primitive(calibration, "ckpt_write_gbyte_s") or c.write_gbyte_s
    return (c.weights_bytes + c.optimizer_bytes) / scenario.training_nodes / (bw * 1e9)


def interruptions_per_s(scenario: S.Scenario) -> float:
    """Rate of faults that stop a checkpoint_restart job: a training node's hardware fault, a
    rack loss, a NaN shard, the coordinator's death (a latency spike slows the job but does not
    stop it)."""
    return sum(fc.rate_per_s(getattr(scenario.faults, fc.name), scenario.training_nodes)
               for fc in FC.classes() if fc.stops_job)


def job_mtbf_s(scenario: S.Scenario, step_time_s: float) -> float:
    """Mean time between interruptions of the job, from the scenario's rates; where every
    rate is 0, from the scheduled interruptions over the fault-free run length."""
    rate = interruptions_per_s(scenario)
    if rate > 0:
        return 1.0 / rate
    scheduled = [e for e in scenario.faults.schedule if FC.get(e.class_).stops_job]
    run_s = scenario.run.steps * step_time_s
    return run_s / len(scheduled) if scheduled else math.inf


def young_daly(scenario: S.Scenario, step_time_s: float,
               calibration: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Young/Daly's first-order optimal checkpoint interval sqrt(2 delta M), delta the
    checkpoint write time and M the job MTBF, in seconds and in steps (clipped to the run)."""
    delta = checkpoint_write_s(scenario, calibration)
    mtbf = job_mtbf_s(scenario, step_time_s)
    interval_s = math.sqrt(2.0 * delta * mtbf) if math.isfinite(mtbf) else math.inf
    steps = scenario.run.steps
    interval_steps = steps if not math.isfinite(interval_s) else int(round(interval_s / step_time_s))
    return {"delta_s": delta, "mtbf_s": mtbf if math.isfinite(mtbf) else None,
            "interval_s": interval_s if math.isfinite(interval_s) else None,
            "step_time_s": step_time_s,
            "interval_steps": max(1, min(steps, interval_steps))}
