"""This machine against what a run needs, before any process starts (keel/capacity.py
decides; this module measures): the worker processes and their memory for any run, and for
an emulated one the real compute of a slot, timed on the scenario's model here in a fraction
of a second, against the wall time the scenario's time scale gives it."""
from __future__ import annotations

import functools
import time

from keel import capacity
from keel.errors import InputError
from keel.scenario import Scenario

MEASURE_S = 0.5   # at most this long timing slots (after one warm-up pass)


@functools.lru_cache(maxsize=8)
def slot_seconds(d_model: int, layers: int, heads: int, context: int, micro_batch: int) -> float:
    """The median wall time of one slot's forward and backward pass on the built-in model, on
    one thread (as each worker computes), measured here."""
    import torch

    from keel.scenario import Model
    from runtime.model import build_model, slot_loss
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(Model(d_model=d_model, layers=layers, heads=heads, context=context), seed=0)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (micro_batch, context), generator=g)
        y = torch.randint(0, 256, (micro_batch, context), generator=g)
        w = torch.ones(micro_batch)
        times = []
        deadline = time.perf_counter() + MEASURE_S
        for k in range(21):
            t0 = time.perf_counter()
            slot_loss(model, x, y, w).backward()
            if k:  # the first pass sets things up
                times.append(time.perf_counter() - t0)
            if k >= 3 and time.perf_counter() > deadline:
                break
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def check_machine(scenario: Scenario, what: str = "keel run") -> None:
    """InputError, one line, when the run does not fit this machine: its worker processes
    (every run), and for an emulated run the time scale (with the scale that would do)."""
    machine = capacity.this_machine()
    why = capacity.processes_fit(scenario.total_nodes, machine)
    if why is not None:
        raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
    if not scenario.emulation.enabled:
        return
    m = scenario.model
    slot_s = slot_seconds(m.d_model, m.layers, m.heads, m.context, scenario.workload.micro_batch)
    speed = max(r.speed for r in scenario.regions)
    why = capacity.time_scale_fits(scenario.emulation.time_scale, slot_s, scenario.workload.step_compute_s, speed,
                                   scenario.training_nodes, machine.cores)
    if why is not None:
        raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
