"""`coordinator_loss` in the twin: the strike, its drawn arrivals, and what it does to the
trainer (`CoordinatorLossMixin`, a mixin of twin.model.Simulation).

The coordinator process dies (a scheduled one is killed: mode "kill"; a drawn one dies of
something else: "external"); its supervisor sees the exit at once
(`fault`, `detect` with detect_s 0 and `recover_start` at one instant) and its successor
has loaded the state and has every worker back `coordinator_restart_s` later (twin/params.py).
Under absorb the workers train on meanwhile and nothing of that is lost: the twin modelled
it as a re-form with no node lost. The trainer runs on, but commits are held (no `step`
event) until the successor is up; then the steps done meanwhile are committed at once (one
`step` event), its abort lands (the step in flight is lost: the workers finish its compute
before they see the abort, StepCost.drain_s), the job pauses for coordinator_reform_s (the new
process group, formed while the workers train on; no slot moves, no state is copied) and
redoes that step. The episode's `recover_end` comes just before the new
generation's first commit, with the runtime's detail: downtime_s (fault to then), detect_s
0, ack_s (death to the successor up), reform_s (ack_s + the pause), state_s 0, redo_s (the
redone step) and gen. Under checkpoint_restart the job stops at the death (what the
workers train meanwhile is thrown away by the relaunch; a checkpoint that an async write
finishes meanwhile still counts, but not one of the step committed at the death, which the
dead coordinator never confirmed: its pause is broken, `Cause.aborts_checkpoint`) and, once
the successor is up, restarts (twin/model.py, `checkpoint_restart`). An episode open when
the coordinator dies goes on as modelled (its commits are held too, so its downtime runs to
the successor); a node fault during the outage too (simplified: in the runtime nobody
re-forms the group until the successor is up).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from keel import recovery as R
from keel.events import Event
from twin.faults import DAY, Cause, FaultInfo

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "coordinator_loss"


def strike(faults: Faults, scheduled: bool) -> None:
    """The coordinator dies; its supervisor sees the exit at once (`detect` at the fault,
    detect_s 0) and the successor is up `coordinator_restart_s` later (a `coordinator_up`)."""
    fid = faults.new_fault(FaultInfo(NAME, R.COORDINATOR, faults.action(NAME)))
    faults.sim.emit_episode("fault", fid, scheduled=scheduled, mode="kill" if scheduled else "external")
    faults.sim.emit_episode("detect", fid, detect_s=0.0)
    faults.sim.emit_episode("recover_start", fid)
    faults.sim.coordinator_down(fid)
    faults.env.process(_successor(faults, fid, faults.params.coordinator_restart_s))


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    while True:
        yield faults.env.timeout(rng.exponential(DAY / table.per_day))
        strike(faults, False)


def _successor(faults: Faults, fid: int, after_s: float) -> Generator:
    yield faults.env.timeout(after_s)
    faults.sim.notify(Cause("coordinator_up", fid, interrupts_run=True))


class CoordinatorLossMixin:
    def init_coordinator_loss(self) -> None:
        # coordinator_loss: fault id -> when the coordinator died, until its successor is up
        self.outages: dict[int, float] = {}
        self.failovers: dict[int, tuple[float, float]] = {}  # fault id -> (died, successor up), absorb
        self.hold_from: float | None = None            # absorb: commits after this wait for the successor
        self.held = False                              # some commit was held since
        self.committed_when_held = 0
        # absorb: recover_end of failovers, written just before the next commit
        self.pending_ends: list[tuple[int, float, float, dict[str, Any]]] = []  # (id, died, formed, detail)

    def coordinator_down(self, fid: int) -> None:
        """The coordinator died (module docstring): under absorb commits are held from now on,
        under checkpoint_restart the job stops."""
        self.outages[fid] = self.env.now
        if not self.absorb:
            self.checkpoints.unconfirmed()
            self.notify(Cause("coordinator_down", fid, interrupts_run=True, aborts_pause=True,
                              aborts_checkpoint=True))
        elif self.hold_from is None:
            self.hold_from = self.env.now
            self.committed_when_held = self.committed_now()

    def _coordinator_up(self, fid: int) -> None:
        """The successor is up: it commits what the workers did meanwhile and aborts the step in
        flight; the job re-forms (absorb) or restarts from the last checkpoint."""
        died = self.outages.pop(fid)
        self.carry_s = None
        if not self.absorb:
            self.restart_for.append(fid)
            return
        self.failovers[fid] = (died, self.env.now)
        if not self.outages:
            if self.held:
                self._append_step(self.env.now, self.committed, self.committed_when_held)
            self.hold_from, self.held = None, False
        self.awaiting_recovery.append(fid)
        self.recovery_s = max(self.recovery_s, self.cost.reformed_s(self.inflight, self.env.now,
                                                                    self.params.coordinator_reform_s))

    def _failover_done(self, fid: int) -> None:
        """A failover's new generation is formed: its recover_end comes just before the next
        commit (`_flush_ends`), or now if the run has no step left."""
        now = self.env.now
        died, up = self.failovers.pop(fid)
        detail = {"detect_s": 0.0, "ack_s": round(up - died, 6), "reform_s": round(now - died, 6),
                  "state_s": 0.0, "gen": self.gen}
        self.pending_ends.append((fid, died, now, detail))
        self.pending_first_since = now  # so that the next commit is logged
        if self.committed >= self.scenario.run.steps:
            self._flush_ends(now, self.committed)

    def _flush_ends(self, t: float, step: int) -> None:
        for fid, died, formed, detail in self.pending_ends:
            info = self.faults.info[fid]
            detail = {"fault_id": fid, "downtime_s": round(t - died, 6), **detail, "redo_s": round(t - formed, 6)}
            self.events.append(Event(round(t, 6), step, "recover_end", info.fault, info.target, info.action, detail))
        self.pending_ends.clear()
