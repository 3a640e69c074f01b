"""This machine against what a run needs, before any process starts (keel/capacity.py
decides; this module measures): the worker processes and their memory for any run, and for
an emulated one the real compute of a slot, timed on the scenario's job here in a fraction
of a second, against the wall time the scenario's time scale gives it."""
from __future__ import annotations

import functools
import time

from keel import capacity
from keel.errors import InputError
from keel.scenario import Scenario

MEASURE_S = 0.5   # at most this long timing slots (after one warm-up pass)


@functools.lru_cache(maxsize=8)
def _slot_seconds(config_hash: str, scenario_json: str, source: str) -> float:
    import json

    import torch

    from keel.scenario import from_dict
    from runtime.job_run import BoundJob, load_spec
    scenario = from_dict(json.loads(scenario_json), source=source)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            job = BoundJob(load_spec(scenario), scenario)
            times = []
            deadline = time.perf_counter() + MEASURE_S
            for k in range(21):
                t0 = time.perf_counter()
                job.slot_vector(0, k)
                if k:  # the first pass sets things up
                    times.append(time.perf_counter() - t0)
                if k >= 3 and time.perf_counter() > deadline:
                    break
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def slot_seconds(scenario: Scenario) -> float:
    """The median wall time of one slot's forward and backward pass of the scenario's job
    (runtime/job_run.py), on one thread (as each worker computes), measured here."""
    import json
    return _slot_seconds(scenario.config_hash(), json.dumps(scenario.plain()), scenario.source)


def check_machine(scenario: Scenario, what: str = "keel run") -> None:
    """InputError, one line, when the run does not fit this machine: its worker processes
    (every run), and for an emulated run the time scale (with the scale that would do)."""
    machine = capacity.this_machine()
    why = capacity.processes_fit(scenario.total_nodes, machine)
    if why is not None:
        raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
    if not scenario.emulation.enabled:
        return
    slot_s = slot_seconds(scenario)
    speed = max(r.speed for r in scenario.regions)
    why = capacity.time_scale_fits(scenario.emulation.time_scale, slot_s, scenario.workload.step_compute_s, speed,
                                   scenario.training_nodes, machine.cores)
    if why is not None:
        raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
