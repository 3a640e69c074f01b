"""Fault injection, each fault real:

- `hardware_fault`: SIGKILL of the target worker process (the coordinator signals the pid
  it spawned; a worker it did not spawn is told to SIGKILL itself).
- `partial_cluster_loss`: SIGKILL of `nodes` live workers of one region, in one loop.
- `network_jitter`: the target's communication path (`CommGate`, passed before each of its
  collectives) sleeps `spike_ms` +-25 % for `duration_s`.
- `data_shard_skew`: the target shard yields NaN weights from step `at_step + 1` (0-based
  index `at_step`) on: the loader is given it as `poisoned`. The poison is data, so it is part of
  every generation's description (a property of the shard, not a message racing the step).
- a hung worker: SIGSTOP, found by missing heartbeats. Not a scenario fault class; tests and
  benchmarks ask for it with `KEEL_INJECT_HANG="node@at_step[,node@at_step]"`.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from keel.scenario import Scenario

HANG_ENV = "KEEL_INJECT_HANG"


@dataclass(frozen=True)
class Planned:
    """One injection the coordinator will perform, in schedule order."""
    index: int
    at_step: int
    cls: str
    target: str
    params: dict[str, Any]
    mode: str = "kill"  # kill | hang | jitter | poison


def planned_faults(scenario: Scenario, no_faults: bool = False, extra_hangs: str | None = None) -> list[Planned]:
    out: list[Planned] = []
    if not no_faults:
        f = scenario.faults
        for i, e in enumerate(scenario.faults.schedule):
            if e.class_ == "network_jitter":
                params = {"spike_ms": e.spike_ms if e.spike_ms is not None else f.network_jitter.spike_ms,
                          "duration_s": e.duration_s if e.duration_s is not None else f.network_jitter.duration_s}
                mode = "jitter"
            elif e.class_ == "partial_cluster_loss":
                params = {"nodes": e.nodes if e.nodes is not None else f.partial_cluster_loss.nodes}
                mode = "kill"
            elif e.class_ == "data_shard_skew":
                params = {"shard": int(e.target.split("/")[1])}
                mode = "poison"
            else:
                params, mode = {}, "kill"
            out.append(Planned(i, e.at_step, e.class_, e.target, params, mode))
    hangs = extra_hangs if extra_hangs is not None else os.environ.get(HANG_ENV, "")
    for j, item in enumerate(x for x in hangs.split(",") if x.strip()):
        node, _, step = item.strip().rpartition("@")
        out.append(Planned(len(out) + j, int(step), "hardware_fault", node, {}, "hang"))
    return sorted(out, key=lambda p: (p.at_step, p.index))


def poison_schedule(planned: list[Planned]) -> list[list[int]]:
    """[[shard, from_step (0-based index of the first poisoned step)], ...]."""
    return [[p.params["shard"], p.at_step] for p in planned if p.mode == "poison"]


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
    step's collectives. The wait is interruptible (an abort cuts it short)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._until = 0.0
        self._spike_s = 0.0

    def set_jitter(self, spike_ms: float, duration_s: float) -> None:
        with self._lock:
            self._spike_s = spike_ms / 1000.0
            self._until = time.monotonic() + duration_s

    def delay(self) -> float:
        with self._lock:
            if time.monotonic() >= self._until or self._spike_s <= 0:
                return 0.0
            return self._spike_s * self._rng.uniform(0.75, 1.25)

    def pass_through(self, interrupt: threading.Event | None = None) -> float:
        """Take the delay; returns the seconds spent."""
        t0 = time.perf_counter()
        d = self.delay()
        if d > 0:
            if interrupt is not None:
                interrupt.wait(d)
            else:
                time.sleep(d)
        return time.perf_counter() - t0


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
