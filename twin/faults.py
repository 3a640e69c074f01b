"""Faults: where and when they strike, and the SimPy processes that follow one (detection,
repair, a spike's end). What the trainer does about them is twin/model.py's and
twin/stragglers.py's; which action a fault gets is keel.recovery.action_for's.

- Drawn faults: each class is a Poisson process in wall time with its own seeded stream (see
  the semantics in twin/model.py for how each picks its target).
- Scheduled faults (keel.recovery.resolve_schedule): fired as step at_step + 1 starts.
- `strike_*`: log the `fault`, change the cluster, start the follow-up processes and tell the
  trainer (a `Cause`).
- `coordinator_loss` (`strike_coordinator`): its supervisor, the dead process's parent, sees
  the exit at once (`detect` at the fault, detect_s 0), and the successor is up, its state
  loaded and every worker rejoined, `coordinator_restart_s` later (a `coordinator_up` cause).
  What the trainer does meanwhile and after is twin/model.py's (`Simulation.coordinator_down`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from keel import recovery as R
from twin.cluster import Node, Spike

if TYPE_CHECKING:
    from twin.model import Simulation

HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True, slots=True)
class Cause:
    """Something the trainer must react to. `interrupts_run`: it changes the steps in flight;
    `aborts_pause`: it breaks a recovery, restart or checkpoint pause too."""
    kind: str               # loss | detected | spike_start | spike_end | nan | rejoin | coordinator_(down|up)
    fault_id: int | None = None
    interrupts_run: bool = False
    aborts_pause: bool = False


@dataclass(frozen=True, slots=True)
class FaultInfo:
    """What a fault id stands for: its class, target (node, region or shard) and action."""
    fault: str
    target: str
    action: str | None
    nodes: tuple[str, ...] = ()   # the nodes a node fault killed


class Faults:
    """The faults of one run: their ids and what each was, the schedule, and the processes."""

    def __init__(self, sim: Simulation, rng_detect: np.random.Generator, rng_hardware: np.random.Generator,
                 rng_jitter: np.random.Generator, rng_rack: np.random.Generator, rng_skew: np.random.Generator,
                 rng_coordinator: np.random.Generator):
        self.sim = sim
        self.env = sim.env
        self.scenario = sim.scenario
        self.params = sim.params
        self.cluster = sim.cluster
        self.rng_detect, self.rng_hardware, self.rng_jitter = rng_detect, rng_hardware, rng_jitter
        self.rng_rack, self.rng_skew, self.rng_coordinator = rng_rack, rng_skew, rng_coordinator
        self.fault_seq = 0
        self.info: dict[int, FaultInfo] = {}
        self.schedule = R.resolve_schedule(self.scenario)
        self.schedule_fired: set[int] = set()
        self.schedule_at: dict[int, list[int]] = {}
        for entry in self.schedule:
            self.schedule_at.setdefault(entry.at_step, []).append(entry.index)

    def start_arrivals(self) -> None:
        """Start the Poisson process of every drawn fault class that is on."""
        faults = self.scenario.faults
        if faults.hardware_fault.mtbf_node_hours > 0:
            self.env.process(self._hardware_arrivals())
        if faults.network_jitter.per_day > 0:
            self.env.process(self._jitter_arrivals())
        if faults.partial_cluster_loss.per_day > 0:
            self.env.process(self._rack_arrivals())
        if faults.data_shard_skew.per_day > 0:
            self.env.process(self._skew_arrivals())
        if faults.coordinator_loss.per_day > 0:
            self.env.process(self._coordinator_arrivals())

    # ------------------------------------------------------------------ the schedule
    def fire_scheduled_at(self, committed: int) -> None:
        """Fire the scheduled faults due when `committed` steps are done (each once)."""
        for index in self.schedule_at.get(committed, ()):
            if index not in self.schedule_fired:
                self.schedule_fired.add(index)
                self.env.process(self._fire_scheduled(index))

    def scheduled_bounds(self, committed: int) -> list[int]:
        """The steps after `committed` at which scheduled faults are still to fire."""
        return [at for at in self.schedule_at
                if at > committed and any(i not in self.schedule_fired for i in self.schedule_at[at])]

    def _fire_scheduled(self, index: int) -> Generator:
        yield self.env.timeout(0.0)  # the same instant, once the trainer waits on the segment
        entry = self.schedule[index]
        if entry.cls == "hardware_fault":
            self.strike_nodes("hardware_fault", entry.target, [entry.target], True)
        elif entry.cls == "partial_cluster_loss":
            live = [n.name for n in self.cluster.order if n.region == entry.target and n.up]
            self.strike_nodes("partial_cluster_loss", entry.target, R.rack_victims(live, entry.nodes), True)
        elif entry.cls == "network_jitter":
            self.strike_spike(entry.target, entry.spike_ms / 1e3, entry.duration_s, True)
        elif entry.cls == "coordinator_loss":
            self.strike_coordinator(True)
        elif not R.shard_skipped(self.scenario.policy.quarantine, self.sim.quarantined, entry.target):
            self.strike_shard(entry.target, True)

    # ------------------------------------------------------------------ striking
    def _new_fault(self, info: FaultInfo) -> int:
        fid = self.fault_seq
        self.fault_seq += 1
        self.info[fid] = info
        return fid

    def _action(self, fault: str) -> str:
        p = self.scenario.policy
        return R.action_for(fault, p.kind, p.quarantine)

    def strike_nodes(self, fault: str, target: str, names: list[str], scheduled: bool) -> None:
        """Kill the up nodes of `names` (one for hardware_fault, a rack's for partial_cluster_loss)."""
        nodes = [self.cluster.nodes[n] for n in names if self.cluster.nodes[n].up]
        if not nodes:
            return
        holding = [n for n in nodes if n.slots > 0]
        fid = self._new_fault(FaultInfo(fault, target, self._action(fault), tuple(n.name for n in nodes)))
        detail: dict[str, Any] = {"scheduled": scheduled}
        if fault == "partial_cluster_loss":
            detail["nodes"] = [n.name for n in nodes]
        if not holding:
            detail["idle"] = True
        self.sim.emit_episode("fault", fid, **detail)
        repair_h = (self.scenario.faults.hardware_fault.repair_hours if fault == "hardware_fault"
                    else self.scenario.faults.partial_cluster_loss.repair_hours)
        for n in nodes:
            self.cluster.update(n, up=False, role=None if n.role == "train" else "down")
            self.env.process(self._repair(n, n.incarnation, repair_h * HOUR))
        if holding:
            p = self.params
            if scheduled and p.detect_at_commit_s is not None:
                # a crash right after a commit: the node's last message was its step report
                delay = p.detect_at_commit_s
            else:
                delay = self._detect_delay(p.detect_kill_s if fault == "hardware_fault" else p.detect_rack_s)
            self.env.process(self._detector(fid, delay))
            self.sim.notify(Cause("loss", fid, interrupts_run=True, aborts_pause=True))

    def strike_spike(self, target: str, spike_s: float, duration_s: float, scheduled: bool) -> None:
        """A latency spike of `spike_s` on `target` (a node or a region) for `duration_s`."""
        fid = self._new_fault(FaultInfo("network_jitter", target, self._action("network_jitter")))
        self.sim.emit_episode("fault", fid, scheduled=scheduled, spike_ms=spike_s * 1e3, duration_s=duration_s)
        self.cluster.spikes[fid] = sp = Spike(target, spike_s, over=self.env.event())
        self.cluster.spike_starts.append((self.env.now, sp))
        self.cluster.touch()  # the step model changed
        self.sim.notify(Cause("spike_start", fid, interrupts_run=True))
        self.env.process(self._spike_end(fid, duration_s))

    def strike_shard(self, shard: str, scheduled: bool) -> None:
        """`shard` yields non-finite values in the step in flight."""
        fid = self._new_fault(FaultInfo("data_shard_skew", shard, self._action("data_shard_skew")))
        self.sim.emit_episode("fault", fid, scheduled=scheduled)
        self.sim.notify(Cause("nan", fid, interrupts_run=True))

    def strike_coordinator(self, scheduled: bool) -> None:
        """The coordinator process dies (a scheduled one is killed: mode "kill"; a drawn one
        dies of something else: "external"). Its supervisor sees the exit at once."""
        fid = self._new_fault(FaultInfo("coordinator_loss", R.COORDINATOR, self._action("coordinator_loss")))
        self.sim.emit_episode("fault", fid, scheduled=scheduled, mode="kill" if scheduled else "external")
        self.sim.emit_episode("detect", fid, detect_s=0.0)
        self.sim.emit_episode("recover_start", fid)
        self.sim.coordinator_down(fid)
        self.env.process(self._successor(fid, self.params.coordinator_restart_s))

    # ------------------------------------------------------------------ drawn arrivals
    def _hardware_arrivals(self) -> Generator:
        order = self.cluster.order
        rate = len(order) / (self.scenario.faults.hardware_fault.mtbf_node_hours * HOUR)
        rng = self.rng_hardware
        while True:
            yield self.env.timeout(rng.exponential(1.0 / rate))
            node = order[int(rng.integers(len(order)))]
            if node.up:
                self.strike_nodes("hardware_fault", node.name, [node.name], False)

    def _jitter_arrivals(self) -> Generator:
        cfg = self.scenario.faults.network_jitter
        order = self.cluster.order
        rng = self.rng_jitter
        while True:
            yield self.env.timeout(rng.exponential(DAY / cfg.per_day))
            node = order[int(rng.integers(len(order)))]
            if node.up and node.role == "train" and node.slots > 0:
                self.strike_spike(node.name, cfg.spike_ms / 1e3, cfg.duration_s, False)

    def _rack_arrivals(self) -> Generator:
        cfg = self.scenario.faults.partial_cluster_loss
        rng = self.rng_rack
        regions = self.scenario.regions
        weights = np.array([r.nodes for r in regions], dtype=float)
        weights /= weights.sum()
        while True:
            yield self.env.timeout(rng.exponential(DAY / cfg.per_day))
            region = regions[int(rng.choice(len(regions), p=weights))].name
            live = [n.name for n in self.cluster.order if n.region == region and n.up]
            if not live:
                continue
            picked = sorted(rng.choice(len(live), size=min(cfg.nodes, len(live)), replace=False))
            self.strike_nodes("partial_cluster_loss", region, [live[i] for i in picked], False)

    def _skew_arrivals(self) -> Generator:
        rng = self.rng_skew
        shards = self.scenario.data.shards
        while True:
            yield self.env.timeout(rng.exponential(DAY / self.scenario.faults.data_shard_skew.per_day))
            shard = f"shard/{int(rng.integers(shards))}"
            if not R.shard_skipped(self.scenario.policy.quarantine, self.sim.quarantined, shard):
                self.strike_shard(shard, False)

    def _coordinator_arrivals(self) -> Generator:
        rng = self.rng_coordinator
        while True:
            yield self.env.timeout(rng.exponential(DAY / self.scenario.faults.coordinator_loss.per_day))
            self.strike_coordinator(False)

    # ------------------------------------------------------------------ after a fault
    def _detect_delay(self, mean: float) -> float:
        spread = min(self.params.heartbeat_s, 2 * mean)
        return max(0.0, mean + spread * (0.5 - float(self.rng_detect.random())))

    def _detector(self, fid: int, delay: float) -> Generator:
        yield self.env.timeout(delay)
        self.sim.emit_episode("detect", fid, after_s=round(delay, 6))
        self.sim.notify(Cause("detected", fid))

    def _successor(self, fid: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        self.sim.notify(Cause("coordinator_up", fid, interrupts_run=True))

    def _repair(self, node: Node, incarnation: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        if node.incarnation != incarnation or node.up:
            return
        self.cluster.update(node, up=True, role="spare", slots=0)
        self.sim.notify(Cause("rejoin", interrupts_run=self.sim.absorb and self.cluster.overloaded()))

    def _spike_end(self, fid: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        sp = self.cluster.spikes[fid]
        sp.active = False
        sp.over.succeed()
        self.cluster.touch()
        if sp.moves:  # parked: back once straggler_window of its heartbeat probes in a row come
            # back good, as in the runtime: none does while another spike covers a parked node,
            # and one that starts meanwhile makes them start over once it is over
            homes = {frm for frm, _, _ in sp.moves}
            last = sp
            while True:
                while (later := next((o for o in self.cluster.spikes.values()
                                      if o.active and any(o.covers(h) for h in homes)), None)) is not None:
                    yield later.over
                    last = later
                since = self.env.now
                yield self.env.timeout(self.sim.cost.probe_wait_s(last))
                struck = [o for t, o in self.cluster.spike_starts if t > since and any(o.covers(h) for h in homes)]
                if not struck:
                    break
                last = struck[-1]  # on still (waited for above), or come and gone: probes start over
        self.sim.notify(Cause("spike_end", fid, interrupts_run=True))
