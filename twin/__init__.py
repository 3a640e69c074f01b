"""The digital twin: a SimPy model of a multi-region training run under faults.

    result = twin.simulate(scenario, seed=None, calibration=None)   # -> TwinResult
    result.events    # list[keel.events.Event], the shared event schema
    result.summary   # keel.metrics.summarize(events) + tool, scenario, config_hash, seed, ...
    twin.simulate_replicas(scenario, replicas, seed=None, calibration=None, processes=None)

Same scenario, seed and calibration: the same events, byte for byte. `twin` never imports the
runtime (or torch); the two meet only in the scenario and the event log.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.events import Event
from keel.metrics import summarize
from keel.scenario import Scenario

__all__ = ["TwinResult", "simulate", "simulate_replicas", "build_summary"]


@dataclass(frozen=True, slots=True)
class TwinResult:
    events: list[Event]
    summary: dict[str, Any]


def _calibration(calibration: dict | str | Path | None) -> tuple[dict | None, str]:
    if not isinstance(calibration, (str, Path)):
        return calibration, "calibration"  # a dict (or None); TwinParams checks it
    from twin.params import load_calibration
    return load_calibration(calibration), str(calibration)


def simulate(scenario: Scenario, seed: int | None = None,
             calibration: dict | str | Path | None = None) -> TwinResult:
    """One seeded run of the twin (seed defaults to run.seed)."""
    from twin.model import Simulation
    from twin.params import TwinParams
    from twin.topology import Topology

    seed = scenario.run.seed if seed is None else int(seed)
    data, source = _calibration(calibration)
    topology = Topology(scenario)
    params = TwinParams.from_scenario(scenario, data, source=source, topology=topology)
    events = Simulation(scenario, params, seed, topology).run()
    return TwinResult(events, build_summary(scenario, events, seed, params.calibrated))


def build_summary(scenario: Scenario, events: list[Event], seed: int,
                  calibrated: tuple[str, ...] = ()) -> dict[str, Any]:
    summary = summarize(events)
    faults = [e for e in events if e.kind == "fault"]
    summary.update({
        "tool": "twin",
        "scenario": scenario.run.name,
        "config_hash": scenario.config_hash(),
        "seed": seed,
        "nodes": scenario.total_nodes,
        "regions": len(scenario.regions),
        "policy": scenario.policy.kind,
        "faults_scheduled": sum(1 for e in faults if e.detail.get("scheduled")),
        "faults_drawn": sum(1 for e in faults if not e.detail.get("scheduled")),
        "calibrated": list(calibrated),
        "completed": bool(events[-1].detail.get("completed", True)),
    })
    return summary


# ----------------------------------------------------------------------------- replicas

def _one_replica(job: tuple[Scenario, int, dict | None]) -> dict[str, Any]:
    scenario, seed, calibration = job
    return simulate(scenario, seed, calibration).summary


_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """Two-sided 95% Student t critical value (table, conservative between entries)."""
    if df <= 0:
        return math.inf
    keys = [k for k in sorted(_T95) if k <= df]
    return _T95[keys[-1]] if df <= 120 else 1.960


def mean_ci95(values: list[float]) -> tuple[float, list[float]]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, [mean, mean]
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, [mean - half, mean + half]


def simulate_replicas(scenario: Scenario, replicas: int, seed: int | None = None,
                      calibration: dict | str | Path | None = None, processes: int | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """`replicas` seeded runs (seeds seed, seed+1, ...), in parallel processes: mean goodput
    with its 95% confidence interval, and every replica's summary."""
    if replicas < 1:
        from keel.errors import InputError
        raise InputError(f"--replicas: expected at least 1, got {replicas}")
    base = scenario.run.seed if seed is None else int(seed)
    data, _ = _calibration(calibration)
    jobs = [(scenario, base + i, data) for i in range(replicas)]
    processes = processes or min(replicas, os.cpu_count() or 1)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=replicas, desc=f"{scenario.run.name} replicas", file=sys.stderr, unit="run")
    summaries: list[dict[str, Any]] = []
    try:
        if processes <= 1:
            for job in jobs:
                summaries.append(_one_replica(job))
                if bar:
                    bar.update()
        else:
            import multiprocessing
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            with context.Pool(processes) as pool:
                for summary in pool.imap(_one_replica, jobs):
                    summaries.append(summary)
                    if bar:
                        bar.update()
    finally:
        if bar:
            bar.close()
    goodput, ci = mean_ci95([s["goodput"] for s in summaries])
    first = summaries[0]
    return {
        "tool": "twin", "scenario": first["scenario"], "config_hash": first["config_hash"],
        "seed": base, "nodes": first["nodes"], "regions": first["regions"], "policy": first["policy"],
        "replicas": replicas, "seeds": [base + i for i in range(replicas)],
        "goodput": goodput, "goodput_ci95": ci,
        "wall_s": statistics.fmean(s["wall_s"] for s in summaries),
        "restarts": statistics.fmean(s["restarts"] for s in summaries),
        "completed": sum(1 for s in summaries if s["completed"]),
        "faults": statistics.fmean(len(s["faults"]) for s in summaries),
        "step_time_s": first["step_time_s"], "steps": first["steps"],
        "summaries": summaries,
    }
