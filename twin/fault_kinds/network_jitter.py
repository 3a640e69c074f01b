"""`network_jitter` in the twin: a latency spike on a node or a region's links for
`duration_s` (twin/cluster.py's `Spike`); what the trainer does about it is
twin/stragglers.py's. A drawn spike strikes a training node that holds slots."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from twin.cluster import Spike
from twin.faults import DAY, Cause, FaultInfo

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "network_jitter"


def strike(faults: Faults, target: str, spike_s: float, duration_s: float, scheduled: bool) -> None:
    """A latency spike of `spike_s` on `target` (a node or a region) for `duration_s`."""
    env, cluster = faults.env, faults.cluster
    fid = faults.new_fault(FaultInfo(NAME, target, faults.action(NAME)))
    faults.sim.emit_episode("fault", fid, scheduled=scheduled, spike_ms=spike_s * 1e3, duration_s=duration_s)
    cluster.spikes[fid] = sp = Spike(target, spike_s, ends_at=env.now + duration_s, over=env.event())
    cluster.spike_starts.append((env.now, sp))
    cluster.touch()  # the step model changed
    faults.sim.notify(Cause("spike_start", fid, interrupts_run=True))
    env.process(_spike_end(faults, fid, duration_s))


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, entry.target, entry.spike_ms / 1e3, entry.duration_s, True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    order = faults.cluster.order
    while True:
        yield faults.env.timeout(rng.exponential(DAY / table.per_day))
        node = order[int(rng.integers(len(order)))]
        if node.up and node.role == "train" and node.slots > 0:
            strike(faults, node.name, table.spike_ms / 1e3, table.duration_s, False)


def _spike_end(faults: Faults, fid: int, after_s: float) -> Generator:
    env, cluster = faults.env, faults.cluster
    yield env.timeout(after_s)
    sp = cluster.spikes[fid]
    sp.active = False
    sp.over.succeed()
    cluster.touch()
    faults.sim.notify(Cause("spike_end", fid, interrupts_run=True))
