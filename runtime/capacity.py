"""This machine against what a run needs, before any process starts (keel/capacity.py
decides; this module measures): the worker processes and their memory for any run, and for
an emulated one the real compute of a slot, timed on the scenario's job here in a fraction
of a second, against the wall time the scenario's time scale gives it."""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import NamedTuple

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


PROBE_SCALE = 1e-3   # the probe's time scale: no machine keeps it, so every step runs flat out
PROBE_STEPS = 8      # the probe's steps; the first two (the connections' set-up) are not counted


class Probe(NamedTuple):
    """What the probe measured here (wall seconds)."""
    step_s: float            # a fault-free step flat out, the median after the first two
    slowest_s: float         # the slowest of them: how far this machine's load makes a step wander
    launch_s: float          # the run's start to its first commit: what a checkpoint_restart relaunch redoes
    heartbeat_late_s: float  # the longest a member went unheard at the coordinator beyond its heartbeat period


def probe_step_seconds(scenario: Scenario) -> Probe:
    """The emulated cluster run here flat out (`Probe` says what it measures): the scenario
    emulated for PROBE_STEPS steps at PROBE_SCALE, no fault injected, no checkpoint,
    heartbeats and the detection timeout kept at sane wall times (0.25 s, 3 s)."""
    import tempfile

    from keel.rundir import read_events
    from runtime import api
    probe = dataclasses.replace(
        scenario,
        emulation=dataclasses.replace(scenario.emulation, enabled=True, time_scale=PROBE_SCALE),
        policy=dataclasses.replace(scenario.policy, heartbeat_s=0.25 / PROBE_SCALE, detect_timeout_s=3.0 / PROBE_SCALE),
        checkpoint=dataclasses.replace(scenario.checkpoint, interval_steps=10 * PROBE_STEPS),
        faults=dataclasses.replace(scenario.faults, schedule=()))
    with tempfile.TemporaryDirectory(prefix="keel-probe-") as tmp:
        summary = api.run_scenario(probe, tmp, steps=PROBE_STEPS, progress=False)
        events = read_events(tmp)
        commits = [e.t for e in events if e.kind == "step"]
        start = next(e.t for e in events if e.kind == "run_start")
    gaps = sorted((b - a) * PROBE_SCALE for a, b in zip(commits[2:], commits[3:]))
    assert gaps, f"the probe committed {len(commits)} steps"
    return Probe(gaps[len(gaps) // 2], gaps[-1], (commits[0] - start) * PROBE_SCALE,
                 float(summary["emulation"].get("heartbeat_late_s", 0.0)))


def emulated_step_floor_s(scenario: Scenario) -> float:
    """A lower bound on the emulated cluster's fault-free step (emulated seconds), by the
    emulation's own account (runtime/emulation): the slots' compute spread evenly over the
    training nodes at their speeds (keel.capacity.step_floor_s; the slowest holder takes at
    least that), then every all-reduce of a common step (keel.wire.rounds, at the scenario's
    parameter count) run through the hierarchical plan (hier.clocks) with each message priced
    by the link emulator, from every node at once. A node's real work runs ahead of its
    emulated clock and waits only at the commit (node.py), so the whole step's real work must
    fit in this step's wall time; a scale judged against a lower bound errs on the faithful side."""
    from keel import hardware, wire
    from runtime.emulation import hier
    from runtime.emulation.netem import CollectivePricer, LinkEmulator
    from runtime.reduction import reduction_format
    w = scenario.workload
    compute = capacity.step_floor_s(scenario.slot_count, w.step_compute_s, training_speeds(scenario))
    ring = hardware.ring_members(scenario, scenario.node_names[:scenario.training_nodes])
    members = [n for region in ring for n in region]
    ranks, k = [], 0
    for region in ring:
        ranks.append(tuple(range(k, k + len(region))))
        k += len(region)
    pricer = CollectivePricer(LinkEmulator(scenario), members)
    clocks = [compute] * len(members)
    for r, (op, elements, size) in enumerate(wire.rounds(w.params, reduction_format(scenario), w.gradient_dtype,
                                                         scenario.slot_count)):
        pricer.bytes_per_element, pricer.key = float(size), f"floor/r{r}"
        clocks = hier.clocks(hier.plan_for(tuple(ranks), elements, op == "max"), clocks, pricer)
    return max(clocks)


def check_machine(scenario: Scenario, what: str = "keel run", progress: bool = True) -> Scenario:
    """The scenario as it will run on this machine, or InputError (one line) when it does not
    fit: its worker processes (every run), and for an emulated run the time scale, checked by
    the slot's compute (instant) and then by a short probe of the emulated cluster itself; a
    time scale of "auto" becomes the one the measurement says this machine keeps."""
    machine = capacity.this_machine()
    why = capacity.processes_fit(scenario.total_nodes, machine)
    if why is not None:
        raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
    if not scenario.emulation.enabled:
        return scenario
    from runtime.api import check_runnable
    check_runnable(scenario)  # the job's own refusals first: timing a job that cannot run says nothing
    w = scenario.workload
    slot_s = slot_seconds(scenario)
    speed = max(r.speed for r in scenario.regions)
    workers = scenario.training_nodes
    scale = scenario.emulation.time_scale
    auto = scale == "auto"
    if not auto:
        why = capacity.time_scale_fits(scale, slot_s, w.step_compute_s, speed, workers, machine.cores)
        if why is not None:  # refused on the compute alone: no probe needed
            raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
    if progress:
        print(f"keel: measuring how fast this machine runs the {workers} emulated workers "
              f"({PROBE_STEPS} fault-free steps flat out)", file=sys.stderr)
    probe = probe_step_seconds(scenario)
    floor_s = emulated_step_floor_s(scenario)
    relaunches = scenario.policy.kind == "checkpoint_restart"
    if not auto:
        why = capacity.probe_fits(scale, probe.step_s, floor_s, workers, machine.cores)
        if why is None and relaunches:
            why = capacity.relaunch_fits(scale, probe.launch_s, scenario.policy.restart_s, workers)
        if why is not None:
            raise InputError(f"{scenario.source}: {why}; refused before {what} starts anything")
        return scenario
    p = scenario.policy
    need = max(capacity.min_time_scale(slot_s, w.step_compute_s, speed, workers, machine.cores),
               capacity.stall_time_scale(probe.slowest_s, floor_s),  # the slowest probed step, and slack
               capacity.relaunch_time_scale(probe.launch_s, p.restart_s) if relaunches else 0.0,
               capacity.detection_time_scale(probe.heartbeat_late_s, p.heartbeat_s, p.detect_timeout_s))
    chosen = capacity.auto_time_scale(need)
    if progress:
        print(f"keel: emulation.time_scale auto -> {chosen:g} (a step takes {probe.step_s * 1000:.3g} ms of real "
              f"work here, {probe.slowest_s * 1000:.3g} ms the slowest, the emulated cluster's at least "
              f"{floor_s * 1000:.3g} ms of emulated time; heartbeats up to {probe.heartbeat_late_s * 1000:.3g} ms "
              f"late; needs >= {capacity.round_up_scale(need):g}, x{capacity.AUTO_HEADROOM:g} for headroom)",
              file=sys.stderr)
    return dataclasses.replace(scenario, emulation=dataclasses.replace(scenario.emulation, time_scale=chosen))


def training_speeds(scenario: Scenario) -> list[float]:
    """The speed of every training node (the hot spares, the last nodes, compute nothing)."""
    speeds = [r.speed for r in scenario.regions for _ in range(r.nodes)]
    return speeds[:scenario.training_nodes]
