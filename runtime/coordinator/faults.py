"""Faults and their episodes: firing the scheduled injections when their step is committed,
noticing a lost worker, judging stragglers, quarantining a bad shard, and the
`checkpoint_restart` baseline. Each fault is an episode in the book (episodes.py); its events
follow fault -> detect -> recover_start -> reslot -> recover_end (the first commit of the new
generation); data faults add `quarantine`; `checkpoint_restart` adds `restart`.

Scheduled faults fire when `at_step` steps are committed; a fault whose step is reached while
another is being recovered fires as soon as the new generation is announced (so schedule two
faults at one step to hit a recovery). A fault that finds nothing to strike (its node or every
node of its region already down, its shard already quarantined) opens no episode, as in the
twin; a spike whose nodes are all lost ends at the next commit.
"""
from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

from keel import recovery as R
from keel.events import Event

from runtime.coordinator import injections
from runtime.coordinator.episodes import Episode, Stage
from runtime.coordinator.generations import JOIN_TIMEOUT_S
from runtime.inject import Planned


class FaultsMixin:
    def init_faults(self) -> None:
        self.fired = 0
        self.restarts = 0
        self.to_park: dict[str, int | None] = {}
        self.to_unpark: dict[str, int | None] = {}
        self.nonfinite: dict[int, dict[str, list[int]]] = {}
        for p in self.planned:  # imported now, not at the commit that fires it (an unknown class fails here)
            injections.module(p.cls)

    def emit_ep(self, kind: str, ep: Episode, t: float | None = None, **detail: Any) -> Event:
        return self.emit(kind, fault=ep.cls, target=ep.target, action=ep.action, t=t,
                         fault_id=ep.fault_id, **detail)

    def _new_episode(self, cls: str, target: str, t: float | None = None, **detail: Any) -> Episode:
        action = R.action_for(cls, self.policy.kind, self.policy.quarantine)
        ep = self.book.new(cls, target, action, self.now() if t is None else t)
        self.emit_ep("fault", ep, t=ep.t, **detail)
        return ep

    # ------------------------------------------------------------------------- injections

    def _fire_due(self, after_announce: bool) -> None:
        """Fire the scheduled faults that are due; at most one that kills or hangs a worker
        per decision point, so a second one at the same step lands during the recovery."""
        while self.fired < len(self.planned) and self.phase == "running":
            p = self.planned[self.fired]
            if p.at_step > self.committed:
                return
            if p.at_step < self.start_step:  # before the checkpoint we resumed from
                self.fired += 1
                continue
            if p.mode in injections.NODE_LOSS_MODES and not after_announce and self.book.node_recovery_under_way(self.slot_map):
                return  # it will land during the recovery, once the new generation is announced
            self.fired += 1
            if self._fire(p):
                return

    def _live(self, node: str) -> bool:
        w = self.workers.get(node)
        return bool(w and w.alive)

    def _fire(self, p: Planned) -> bool:
        """Perform `p` by its class's injection (injections/<class>.py); True where it killed
        or stopped a worker."""
        planned = self.fired - 1  # its place in self.planned: a successor replays it as fired (snapshot.py)
        return injections.module(p.cls).fire(self, p, planned)

    # ------------------------------------------------------------------------- a lost worker

    def _lost(self, w: Any, how: str) -> None:
        if not w.alive:
            return
        last_seen = w.last_seen
        w.alive = False
        w.role = "dead"
        if w.proc is not None and w.proc.poll() is None:
            w.proc.signal(signal.SIGKILL)  # fence: a hung worker never comes back
        self._drop_channel(w)
        self.pending_acks.discard(w.node)
        if self.phase in ("finishing", "finished", "restarting"):
            return
        spike = self.book.jitter_on(w.node)
        if spike is not None and not any(self._live(n) for n in spike.nodes):
            # nothing of the spike is left to sit out or move back: it ends at the next commit
            spike.parked = False
            if spike.stage == Stage.DETECTED:
                spike.stage = Stage.RECOVERING
            if spike.recovering and spike.end_gen is None:
                spike.end_gen = self.gen
        ep = self.book.of_killed(w.node)
        if ep is None:  # nobody injected this: a real failure
            ep = self._new_episode("hardware_fault", w.node, t=max(0.0, (last_seen - self.t0) / self.scale),
                                   nodes=[w.node], mode="external")
            self.book.killed[w.node] = ep.fault_id
        now = self.now()
        ep.detect(now)
        self.emit_ep("detect", ep, node=w.node, how=how, detect_s=now - ep.t)
        was_member = w.node in self.slot_map and self.phase in ("running", "aborting")
        if self.phase == "joining":
            return
        if self.policy.kind == "checkpoint_restart":
            if was_member:
                self._restart(ep)
            return
        if not was_member:  # a spare or a parked straggler: nothing to re-form
            w.parked = None
            if not ep.member_lost and not ep.ended and all(not self.workers[n].alive for n in ep.nodes):
                ep.stage = Stage.RECOVERING
                self.emit_ep("recover_start", ep, gen=self.gen, lost=[w.node], spare=True)
                self._end_episode(ep)
            return
        ep.member_lost = True
        if ep.start_recovery():
            self.emit_ep("recover_start", ep, gen=self.gen, lost=[w.node])
        self._abort()

    # ------------------------------------------------------------------------- stragglers

    def _watch_stragglers(self, reps: dict[str, dict]) -> None:
        """Apply the straggler watch's verdicts on one committed step to the spikes' episodes."""
        may_park = self.policy.kind == "absorb" and len(self.slot_map) > 1
        for v in self.watch.judge(reps, may_park):
            ep = self.book.jitter_on(v.node)
            if v.slow:
                if ep is not None and ep.detect(self.now()):
                    self.emit_ep("detect", ep, node=v.node, how="slow steps", per_slot_s=v.per_slot_s,
                                 median_per_slot_s=v.median_per_slot_s)
                if v.park:
                    if ep is not None and ep.start_recovery():
                        ep.parked = True
                        self.emit_ep("recover_start", ep, node=v.node, gen=self.gen)
                    self.to_park[v.node] = ep.fault_id if ep is not None else None
                    self._abort()
                    return
            elif ep is not None and ep.stage == Stage.DETECTED:
                ep.ok += 1  # detected but never moved: over once it is fine for a window
                if R.window_full(ep.ok, self.policy.straggler_window):
                    ep.stage = Stage.RECOVERING
                    self._end_episode(ep)

    def _probe(self, w: Any, probe_s: float) -> None:
        """A parked straggler's measured communication delay; back in once it would no longer
        be a straggler for `straggler_window` heartbeats in a row."""
        if self.watch.probe(w.node, probe_s) and self.phase == "running" and w.node not in self.to_unpark:
            ep = self.book.jitter_on(w.node)
            if ep is not None:
                ep.parked = False
                ep.end_gen = self.gen + 1
            self.to_unpark[w.node] = ep.fault_id if ep is not None else None
            self._abort()

    # ------------------------------------------------------------------------- quarantine

    def _try_nonfinite(self, step: int) -> None:
        got = self.nonfinite.get(step, {})
        if any(m not in got for m in self.members):
            return
        suspects = sorted({s for v in got.values() for s in v})
        ep = self.book.bad_shard(suspects)
        if ep is None:
            ep = self._new_episode("data_shard_skew", f"shard/{suspects[0]}" if suspects else "shard/?",
                                   mode="external")
        now = self.now()
        ep.detect(now)
        self.emit_ep("detect", ep, step_index=step, shards=suspects, how="non-finite reduced gradient")
        if not suspects:
            self.failure = f"step {step + 1}: non-finite gradient not attributable to a data shard"
            return
        if ep.action == R.FAIL_ACTION:
            self.failure = f"step {step + 1}: shard(s) {suspects} yield non-finite values and policy.quarantine is false"
            return
        new = set(suspects) - self.quarantine
        self.quarantine |= set(suspects)
        if ep.start_recovery():
            self.emit_ep("recover_start", ep, gen=self.gen)
        self.emit_ep("quarantine", ep, shards=sorted(new or suspects), quarantine=sorted(self.quarantine),
                     step_index=step)
        if self.policy.kind == "checkpoint_restart":
            self._restart(ep)
            return
        ep.end_step = step + 1
        self.nonfinite.pop(step, None)
        for m in self.members:
            self.workers[m].chan.send({"type": "quarantine", "gen": self.gen, "step": step,
                                       "shards": sorted(self.quarantine)})

    # ------------------------------------------------------------------------- checkpoint_restart

    def _restart(self, ep: Episode) -> None:
        """The baseline: stop every worker, relaunch them all, load the newest checkpoint."""
        from runtime import checkpoint as ck
        if self.phase == "restarting":
            return
        if not self.spawn_local:
            self.failure = "policy checkpoint_restart needs workers spawned by keel run"
            return
        self.phase = "restarting"
        self.restarts += 1
        decided = self.now()  # emulated: the relaunch's restart_s runs from the decision (below)
        # a checkpoint of a step not committed here (written by workers while a dead
        # coordinator's successor was starting) is not one this run has reached. Verifying
        # reads and hashes every file: in the background, so that a large checkpoint is not
        # taken for a hung coordinator (succession.in_background)
        latest = self.in_background(lambda: ck.find_latest(self.ckpt_dir, at_most=self.committed))
        step = int(latest.name.split("-")[1]) if latest is not None else 0
        self.emit_ep("restart", ep, from_step=step, checkpoint=str(latest) if latest else None,
                     lost_steps=self.committed - step)
        ep.stage = Stage.RECOVERING
        for w in self.workers.values():
            if w.alive:
                w.alive = False
                if w.proc is not None:
                    w.proc.signal(signal.SIGKILL)
            self._drop_channel(w)
        for w in self.workers.values():
            if w.proc is not None:
                try:
                    w.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self.committed = step
        self.start_step = min(self.start_step, step)
        self.reports = {}
        self.load_path = str(latest) if latest is not None else None
        self.gen_t[self.gen + 1] = {"abort_s": 0.0}
        # a relaunch: fresh interpreters pay the real import and start-up; an emulated cluster
        # forks its workers (fast) and starts the generation policy.restart_s emulated seconds
        # after the decision: the real work since (verifying the checkpoint, stopping every
        # worker, forking the new ones) is the test bed's stand-in for the relaunch restart_s
        # describes, absorbed by it as every emulated duration absorbs the real work it stands
        # for (issue 25: counted on top, it added 14 s to a 18.4 s relaunch at time scale 0.07)
        self.not_before = decided + self.policy.restart_s if self.emulated else 0.0
        for n in self.nodes:
            self.spawn(n, fresh_interpreter=not self.emulated)
        ep.end_gen = self.gen + 1
        self.phase = "joining"
        self.join_deadline = time.monotonic() + JOIN_TIMEOUT_S
