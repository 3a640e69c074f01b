"""Faults: their ids and what each was, the schedule, and what every class shares (a node
fault's detection and repair). Each class's own behaviour (its strike, its drawn arrivals,
what follows) is its module's in twin/fault_kinds, dispatched by the registry
(keel/fault_classes.py). What the trainer does about them is twin/model.py's and
twin/stragglers.py's; which action a fault gets is keel.recovery.action_for's.

- Drawn faults: each class is a Poisson process in wall time with its own seeded stream (see
  the semantics in twin/model.py for how each picks its target).
- Scheduled faults (keel.recovery.resolve_schedule): fired as step at_step + 1 starts.
- A strike logs the `fault`, changes the cluster, starts the follow-up processes and tells the
  trainer (a `Cause`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from keel import fault_classes as FC
from keel import recovery as R
from twin import fault_kinds
from twin.cluster import Node

if TYPE_CHECKING:
    from twin.model import Simulation

HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True, slots=True)
class Cause:
    """Something the trainer must react to. `interrupts_run`: it changes the steps in flight;
    `aborts_pause`: it breaks a recovery or restart pause too; `aborts_checkpoint`: it breaks
    a checkpoint's pause: the job stops, or the writer is lost (every node holds the whole
    state and the lowest rank writes it, as in the runtime: another node's loss does not stop
    the write)."""
    kind: str               # loss | detected | spike_start | spike_end | probes_good | nan | rejoin | coordinator_(down|up)
    fault_id: int | None = None
    interrupts_run: bool = False
    aborts_pause: bool = False
    aborts_checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class FaultInfo:
    """What a fault id stands for: its class, target (node, region or shard) and action."""
    fault: str
    target: str
    action: str | None
    nodes: tuple[str, ...] = ()   # the nodes a node fault killed


class Faults:
    """The faults of one run: their ids and what each was, the schedule, and the processes."""

    def __init__(self, sim: Simulation, rng_detect: np.random.Generator, rngs: dict[str, np.random.Generator]):
        """`rngs`: one stream per fault class (its drawn arrivals), by name."""
        self.sim = sim
        self.env = sim.env
        self.scenario = sim.scenario
        self.params = sim.params
        self.cluster = sim.cluster
        self.rng_detect = rng_detect
        self.rngs = rngs
        self.fault_seq = 0
        self.info: dict[int, FaultInfo] = {}
        self.schedule = R.resolve_schedule(self.scenario)
        self.schedule_fired: set[int] = set()
        self.schedule_at: dict[int, list[int]] = {}
        for entry in self.schedule:
            self.schedule_at.setdefault(entry.at_step, []).append(entry.index)

    def start_arrivals(self) -> None:
        """Start the Poisson process of every drawn fault class that is on."""
        for fc in FC.classes():
            table = getattr(self.scenario.faults, fc.name)
            if getattr(table, fc.rate_key) > 0:
                self.env.process(fault_kinds.module(fc.name).arrivals(self, table, self.rngs[fc.name]))

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
        fault_kinds.module(entry.cls).fire_scheduled(self, entry)

    # ------------------------------------------------------------------ striking
    def new_fault(self, info: FaultInfo) -> int:
        fid = self.fault_seq
        self.fault_seq += 1
        self.info[fid] = info
        return fid

    def action(self, fault: str) -> str:
        p = self.scenario.policy
        return R.action_for(fault, p.kind, p.quarantine)

    def strike_nodes(self, fault: str, target: str, names: list[str], scheduled: bool, *, repair_s: float | None,
                     detect_mean_s: float, list_nodes: bool = False, at_commit_s: float | None = None) -> None:
        """Take the up nodes of `names` (a class's module says which: one node, a rack's, a
        cut's), each back `repair_s` later (None: not within the run); found `detect_mean_s` (a
        spread around it) later, or, struck right after a commit, `at_commit_s` (by default the
        params' detect_at_commit_s). The fault event lists the nodes where `list_nodes`."""
        nodes = [self.cluster.nodes[n] for n in names if self.cluster.nodes[n].up]
        if not nodes:
            return
        holding = [n for n in nodes if n.slots > 0]
        fid = self.new_fault(FaultInfo(fault, target, self.action(fault), tuple(n.name for n in nodes)))
        detail: dict[str, Any] = {"scheduled": scheduled}
        if list_nodes:
            detail["nodes"] = [n.name for n in nodes]
        if not holding:
            detail["idle"] = True
        self.sim.emit_episode("fault", fid, **detail)
        writer = self.cluster.writer()
        for n in nodes:
            self.cluster.update(n, up=False, role=None if n.role == "train" else "down")
            if repair_s is not None:
                self.env.process(self._repair(n, n.incarnation, repair_s))
        if holding:
            at_commit = at_commit_s if at_commit_s is not None else self.params.detect_at_commit_s
            if scheduled and at_commit is not None:
                # struck right after a commit: the node's last message was its step report
                delay = at_commit
            else:
                delay = self._detect_delay(detect_mean_s)
            self.env.process(self._detector(fid, delay))
            self.sim.notify(Cause("loss", fid, interrupts_run=True, aborts_pause=True,
                                  aborts_checkpoint=writer in nodes))

    # ------------------------------------------------------------------ after a fault
    def _detect_delay(self, mean: float) -> float:
        spread = min(self.params.heartbeat_s, 2 * mean)
        return max(0.0, mean + spread * (0.5 - float(self.rng_detect.random())))

    def _detector(self, fid: int, delay: float) -> Generator:
        yield self.env.timeout(delay)
        self.sim.emit_episode("detect", fid, after_s=round(delay, 6))
        self.sim.notify(Cause("detected", fid))

    def _repair(self, node: Node, incarnation: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        if node.incarnation != incarnation or node.up:
            return
        self.cluster.update(node, up=True, role="spare", slots=0)
        self.sim.notify(Cause("rejoin", interrupts_run=self.sim.absorb and self.cluster.overloaded()))
