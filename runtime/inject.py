"""Fault injection, each fault real: the plan (`planned_faults`, modes from the registry,
keel/fault_classes.py), the worker's side (`CommGate`, the poison schedule) and what each
class does; the coordinator's side of each is runtime/coordinator/injections/<class>.py.

- `hardware_fault`: SIGKILL of the target worker process (the coordinator signals the pid
  it spawned; a worker it did not spawn is told to SIGKILL itself).
- `partial_cluster_loss`: SIGKILL of `nodes` live workers of one region, in one loop.
- `network_jitter`: the target's communication path (`CommGate`, passed before each of its
  collectives) sleeps `spike_ms` +-25 % (`keel.scenario.spike_factor`) for `duration_s`,
  from its first pass of step `at_step + 1` on (the schedule is part of every generation's
  description, as the poison is).
- `data_shard_skew`: the target shard yields NaN weights from step `at_step + 1` (0-based
  index `at_step`) on: the loader is given it as `poisoned`. The poison is data, so it is part of
  every generation's description (a property of the shard, not a message racing the step).
- `network_partition`: the target's live workers (a node, or a region's) frozen by SIGSTOP in
  one loop: silent, no connection reset, found only by missing heartbeats, then fenced
  (runtime/coordinator/injections/network_partition.py).
- a hung worker: SIGSTOP, found by missing heartbeats. Not a scenario fault class; tests and
  benchmarks ask for it with `KEEL_INJECT_HANG="node@at_step[,node@at_step]"`.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from keel import fault_classes as FC
from keel.recovery import resolve_schedule
from keel.scenario import Scenario, spike_factor

HANG_ENV = "KEEL_INJECT_HANG"


@dataclass(frozen=True)
class Planned:
    """One injection the coordinator will perform, in schedule order."""
    index: int
    at_step: int
    cls: str
    target: str
    params: dict[str, Any]
    mode: str = "kill"  # kill | hang | jitter | poison | coordinator | partition


def planned_faults(scenario: Scenario, no_faults: bool = False, extra_hangs: str | None = None) -> list[Planned]:
    """The scheduled faults (keel.recovery.resolve_schedule) as injections, plus test hangs."""
    out: list[Planned] = []
    if not no_faults:
        out = [Planned(r.index, r.at_step, r.cls, r.target, r.params(), FC.get(r.cls).injection)
               for r in resolve_schedule(scenario)]
    hangs = extra_hangs if extra_hangs is not None else os.environ.get(HANG_ENV, "")
    for j, item in enumerate(x for x in hangs.split(",") if x.strip()):
        node, _, step = item.strip().rpartition("@")
        out.append(Planned(len(out) + j, int(step), "hardware_fault", node, {}, "hang"))
    return sorted(out, key=lambda p: (p.at_step, p.index))


def poison_schedule(planned: list[Planned]) -> list[list[int]]:
    """[[shard, from_step (0-based index of the first poisoned step)], ...]."""
    return [[p.params["shard"], p.at_step] for p in planned if p.mode == "poison"]


def jitter_schedule(planned: list[Planned], from_step: int = 0) -> list[list]:
    """[[index, target, from_step (0-based index of the first spiked step), spike_ms,
    duration_s], ...] for the scheduled spikes a run starting at `from_step` still has."""
    return [[p.index, p.target, p.at_step, p.params["spike_ms"], p.params["duration_s"]]
            for p in planned if p.mode == "jitter" and p.at_step >= from_step]


def poisoned_at(schedule: list[list[int]], step: int) -> frozenset[int]:
    return frozenset(shard for shard, start in schedule if step >= start)


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class CommGate:
    """The worker's communication path: the injected delay, if any, is taken here, before each
    step's collectives. The wait is interruptible (an abort cuts it short).

    A scheduled spike starts at the step boundary, like a poisoned shard: each generation
    hands the gate the schedule (`expect`), and the first pass of step `at_step` (0-based)
    or later starts it, so it always catches the step after the commit of `at_step`, as the
    twin models it, never racing the coordinator's message. The message (`start`) still comes,
    for a worker that is not computing then (a spare, a parked straggler) or joined from
    elsewhere; a spike is started once, by whichever comes first. The delay of each pass is
    `spike_ms x keel.scenario.spike_factor(seed, node, step)` (probes count on their own)."""

    def __init__(self, seed: int, node: str, scale: float = 1.0, sleeps: bool = True):
        self.seed = seed
        self.node = node
        self.scale = scale    # wall seconds per second of the schedule (an emulated cluster's time_scale)
        self.sleeps = sleeps  # False in an emulated cluster: the delay is added to the messages' times
        self._lock = threading.Lock()
        self._until = 0.0
        self._spike_s = 0.0
        self.scope: str | None = None  # the spike now: "node" (the node's messages) or "region" (its links)
        self._expected: list[list] = []   # [[index, from_step, spike_ms, duration_s, scope], ...]
        self._started: set[int] = set()
        self._probes = 0

    def expect(self, schedule: list[list]) -> None:
        """The scheduled spikes on this node: [[index, from_step, spike_ms, duration_s, scope], ...]."""
        with self._lock:
            self._expected = [list(e) for e in schedule]

    def start(self, index: int, spike_ms: float, duration_s: float, scope: str = "node") -> None:
        with self._lock:
            self._start(index, spike_ms, duration_s, scope)

    def _start(self, index: int, spike_ms: float, duration_s: float, scope: str) -> None:
        if index in self._started:
            return
        self._started.add(index)
        self._spike_s = spike_ms / 1000.0
        self.scope = scope
        self._until = time.monotonic() + duration_s * self.scale

    def delay(self, step: int | None = None) -> float:
        """The delay of a pass, in the schedule's seconds (0 when no spike is on)."""
        with self._lock:
            if step is not None:
                for index, from_step, spike_ms, duration_s, scope in self._expected:
                    if step >= from_step:
                        self._start(index, spike_ms, duration_s, scope)
            if time.monotonic() >= self._until or self._spike_s <= 0:
                return 0.0
            if step is None:
                self._probes += 1
                key: int | str = f"probe-{self._probes}"
            else:
                key = step
            return self._spike_s * spike_factor(self.seed, self.node, key)

    def pass_through(self, interrupt: threading.Event | None = None, step: int | None = None) -> float:
        """Take the delay (of 0-based step `step`, or of a probe); returns the seconds spent
        (without `sleeps`: returns the delay at once, for the caller to add to its clock)."""
        t0 = time.perf_counter()
        d = self.delay(step)
        if not self.sleeps:
            return d
        if d > 0:
            if interrupt is not None:
                interrupt.wait(d)
            else:
                time.sleep(d)
        return time.perf_counter() - t0


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
