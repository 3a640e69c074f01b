"""The digital twin: a SimPy model of a multi-region training run under faults.

    result = twin.simulate(scenario, seed=None, calibration=None)   # -> TwinResult
    result.events    # list[keel.events.Event], the shared event schema
    result.summary   # keel.metrics.summarize(events) + tool, scenario, config_hash, seed, ...
    twin.simulate_replicas(scenario, replicas, seed=None, calibration=None, processes=None)
    twin.load_calibration(path)                              # keel.calibration.load

Same scenario, seed and calibration: the same events, byte for byte. `twin` never imports the
runtime (or torch); the two meet only in the scenario and the event log.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.calibration import CalibrationError, load as load_calibration
from keel.events import Event
from keel.metrics import summarize
from keel.scenario import Scenario
from keel.progress import progress_bar
from keel.stats import mean_ci95
from twin.replicas import LocalRunner, SerialRunner

__all__ = ["TwinResult", "simulate", "simulate_replicas", "LocalRunner", "SerialRunner", "build_summary",
           "load_calibration", "CalibrationError"]


@dataclass(frozen=True, slots=True)
class TwinResult:
    events: list[Event]
    summary: dict[str, Any]


def _calibration(calibration: dict | str | Path | None) -> tuple[dict | None, str]:
    if not isinstance(calibration, (str, Path)):
        return calibration, "calibration"  # a dict (or None); TwinParams checks it
    return load_calibration(calibration), str(calibration)


def _simulation(scenario: Scenario, calibration: dict | str | Path | None, seed: int | None):
    from twin.model import Simulation
    from twin.params import TwinParams
    from twin.topology import Topology
    data, source = _calibration(calibration)
    topology = Topology(scenario)
    params = TwinParams.from_scenario(scenario, data, source=source, topology=topology)
    return Simulation(scenario, params, scenario.run.seed if seed is None else int(seed), topology), params


def simulate(scenario: Scenario, seed: int | None = None,
             calibration: dict | str | Path | None = None) -> TwinResult:
    """One seeded run of the twin (seed defaults to run.seed)."""
    seed = scenario.run.seed if seed is None else int(seed)
    sim, params = _simulation(scenario, calibration, seed)
    events = sim.run()
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
    bar = progress_bar(total=replicas, desc=f"{scenario.run.name} replicas", unit="run", enabled=progress)
    summaries: list[dict[str, Any]] = []
    try:
        with LocalRunner(_one_replica, processes) as runner:
            for summary in runner.imap(jobs):
                summaries.append(summary)
                bar.update()
    finally:
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
