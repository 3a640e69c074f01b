"""Generations and commits: joining, announcing a generation, aborting it, planning the next
(planning.plan_generation), committing steps as every member reports them, and ending the
episodes whose recovery a generation or a commit completes.

A step is committed when every member of the generation has reported it, with identical
losses (the reduction is deterministic). A loss, a straggler to move out or back, or a
restart ends the current generation: the coordinator sends `abort`, every live member leaves
its collective at once and acknowledges with its committed step, and the next generation is
announced. Its members form a fresh gloo group on `gen{g}/`; when someone is behind (a hot
spare, a returning straggler) the live peer that committed the most steps broadcasts weights
and optimizer state.
"""
from __future__ import annotations

import time
from typing import Any

from keel import recovery as R
from keel.metrics import median_full_membership_interval_s

from runtime.coordinator.episodes import Episode, Stage
from runtime.coordinator.planning import Loss, View, WorkerView, initial_slot_map, plan_generation
from runtime.inject import jitter_schedule

JOIN_TIMEOUT_S = 600.0


RELAUNCH_TOLERANCE = 0.05  # a relaunch announced later than this fraction of restart_s after its
                           # emulated end outran it: an unfaithful emulation (docs/emulation.md)


class GenerationsMixin:
    def init_generations(self) -> None:
        self.gen = -1
        self.gen_start_step = 0
        self.members: list[str] = []
        self.slot_map: dict[str, list[int]] = {}
        self.losses: dict[int, float] = {}
        self.reports: dict[int, dict[str, dict]] = {}
        self.pending_acks: set[str] = set()
        self.abort_deadline = 0.0
        self.t_abort = 0.0
        self.gen_t: dict[int, dict[str, float]] = {}   # per generation: abort_s, pg_s, state_s, ready, announced
        self.intervals: list[tuple[int, float]] = []  # (members, seconds) per clean commit interval
        self.last_commit_t: float | None = None
        self.last_event_was_commit = False
        self.last_progress = time.monotonic()
        self.final_sha: str | None = None
        self.not_before = 0.0  # emulated: the next generation starts no earlier (a relaunch's restart_s)

    # ------------------------------------------------------------------------- the view

    def view(self) -> View:
        """What the slot planner needs to know, as plain data."""
        losses = {}
        for n in self.slot_map:
            ep = self.book.of_killed(n)
            if ep is not None:
                losses[n] = Loss(ep.fault_id, ep.action, ep.target)
        workers = {n: WorkerView(alive=w.alive, joined=w.joined, committed=w.committed,
                                 parked=tuple(w.parked) if w.parked is not None else None,
                                 per_slot_s=self.watch.per_slot.get(n))
                   for n, w in self.workers.items()}
        return View(nodes=tuple(self.nodes), region_speed={r.name: r.speed for r in self.sc.regions},
                    slot_map={m: tuple(s) for m, s in self.slot_map.items()}, workers=workers,
                    committed=self.committed, to_park=dict(self.to_park), to_unpark=dict(self.to_unpark),
                    losses=losses)

    # ------------------------------------------------------------------------- joining

    def _check_joined(self) -> None:
        expected = [n for n in self.nodes if n in self.workers and self.workers[n].alive] if self.spawn_local else self.nodes
        if all(n in self.workers and self.workers[n].joined for n in expected) and expected:
            self._initial_generation()
        elif self.spawn_local and not expected:
            # every process this run started died before joining: nothing will ever join
            self.failure = (f"every worker process exited before joining the run (their output: "
                            f"{self.out / 'logs'})")
        elif time.monotonic() > self.join_deadline:
            missing = [n for n in expected if not (n in self.workers and self.workers[n].joined)]
            self.failure = f"workers did not join within {JOIN_TIMEOUT_S:.0f} s: {', '.join(missing)}"

    def _initial_generation(self) -> None:
        self.slot_map = initial_slot_map(self.view(), len(self.training), self.sc.slot_count)
        for w in self.workers.values():
            if w.alive:
                w.committed = 0
        self._announce(load=self.load_path, start=self.committed, force_broadcast=self.load_path is not None)
        self.load_path = None

    # ------------------------------------------------------------------------- generations

    def _state_source(self, live_members: list, start: int, force_broadcast: bool) -> int:
        """The rank that sends the state to the members that are behind: the first up-to-date
        member of the region keel.recovery.state_source_region picks (a resume from a
        checkpoint: the first up-to-date member, which reads it and sends it to all)."""
        fresh = [i for i, w in enumerate(live_members) if w.committed == start]
        behind = [i for i, w in enumerate(live_members) if w.committed != start]
        if not fresh:
            return 0
        if force_broadcast or not behind:
            return fresh[0]
        from keel.hardware import message_latency_s
        regions = list(dict.fromkeys(self.region_of[live_members[i].node] for i in fresh))
        pick = R.state_source_region(regions, [self.region_of[live_members[i].node] for i in behind],
                                     lambda a, b: message_latency_s(self.sc, a, b))
        return next(i for i in fresh if self.region_of[live_members[i].node] == pick)

    def _announce(self, *, load: str | None, start: int, force_broadcast: bool = False) -> None:
        self.gen += 1
        self.succeeding = False
        self.members = sorted(self.slot_map, key=self.order.get)
        live_members = [self.workers[m] for m in self.members]
        source = self._state_source(live_members, start, force_broadcast)
        behind = [i for i, w in enumerate(live_members) if i != source and (force_broadcast or w.committed != start)]
        self.reports = {k: v for k, v in self.reports.items() if k <= start}
        self.nonfinite = {}
        base = {"type": "gen", "gen": self.gen, "world": len(self.members), "members": self.members,
                "slot_map": self.slot_map, "start_step": start, "source": source, "behind": behind,
                "load": load, "quarantine": sorted(self.quarantine), "poison": self.poison,
                "jitter": jitter_schedule(self.planned, start), "not_before": self.not_before}
        self.gen_t.setdefault(self.gen, {})["announced"] = self.now()
        if self.emulated and self.not_before > 0:  # a relaunch (checkpoint_restart): restart_s is emulated,
            # and the real stop, checkpoint check and fork must fit in it for the emulation to hold
            late = self.now() - self.not_before
            st = self.emu_stats
            st["relaunches"] = st.get("relaunches", 0) + 1
            st["relaunch_late_s"] = max(st.get("relaunch_late_s", 0.0), late)
            if late > RELAUNCH_TOLERANCE * self.policy.restart_s:
                st["relaunch_overruns"] = st.get("relaunch_overruns", 0) + 1
            self.not_before = 0.0  # counted once: the workers have it in this announcement
        self.watch.new_generation(self.members)
        for rank, m in enumerate(self.members):
            w = self.workers[m]
            w.role = "member"
            w.chan.send({**base, "rank": rank, "slots": self.slot_map[m]})
        for w in self.workers.values():
            if w.alive and w.joined and w.node not in self.slot_map:
                w.role = "standby"
                if w.chan is not None:
                    w.chan.send({"type": "standby", "gen": self.gen})
        self.gen_start_step = start
        self.last_progress = time.monotonic()
        if start >= self.total:
            # a generation formed after the last step (a straggler moving back, a loss at the
            # very end): its members only sync state and report done; nothing is left to run
            self._end_due_episodes(None)
            self.phase = "finishing"
            self._check_finished()
            return
        self.phase = "running"
        self._fire_due(after_announce=True)

    def _abort(self) -> None:
        """End the current generation: every live member leaves its collective and says at
        which step it stands."""
        if self.phase == "aborting":
            return
        self.phase = "aborting"
        self.t_abort = self.now()
        self.pending_acks = {m for m in self.members if self.workers[m].alive}
        for m in self.pending_acks:
            if self.workers[m].chan is not None:
                self.workers[m].chan.send({"type": "abort", "gen": self.gen})
        self.abort_deadline = time.monotonic() + self._abort_wait_s()

    def _abort_wait_s(self) -> float:
        """How long the members of an aborted generation have to acknowledge (wall seconds)."""
        return max(2.0, 2 * self.policy.detect_timeout_s * self.scale)

    def _next_generation(self) -> None:
        plan = plan_generation(self.view())
        self.to_park, self.to_unpark = {}, {}
        for node in plan.unparked:
            self.workers[node].parked = None
            self.watch.back_in(node)
        for node, slots in plan.parked.items():
            self.workers[node].parked = slots
        if plan.failure:
            self.failure = plan.failure
            return
        # a step that some survivor committed before the abort is committed now
        while self.committed < plan.start:
            k = self.committed + 1
            reps = self.reports.get(k, {})
            if not reps:
                self.failure = f"step {k} committed by a survivor but its report is missing"
                return
            self._commit(k, next(iter(reps.values()))["loss"], {}, check=False)
        slot_map = plan.slot_map
        for fid, mv in sorted(plan.moves.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            ep = self.book.get(fid)
            detail = {"gen": self.gen + 1, "moves": [[s, a, b] for s, a, b in mv],
                      "slot_map": {m: slot_map[m] for m in sorted(slot_map, key=self.order.get)}}
            if ep is not None:
                self.emit_ep("reslot", ep, **detail)
            else:
                self.emit("reslot", action=R.ABSORB_ACTION["network_jitter"], **detail)
        self.slot_map = slot_map
        self.gen_t.setdefault(self.gen + 1, {})["abort_s"] = self.now() - self.t_abort
        self.book.end_with_generation(self.gen + 1)
        self._announce(load=None, start=plan.start)

    # ------------------------------------------------------------------------- commits

    def _try_commit(self) -> None:
        while self.phase == "running":
            k = self.committed + 1
            reps = self.reports.get(k)
            if not reps or any(m not in reps for m in self.members):
                return
            losses = {repr(reps[m]["loss"]) for m in self.members}
            if len(losses) > 1:
                self.failure = f"members disagree on the loss of step {k}: {sorted(losses)} (non-deterministic reduction?)"
                return
            self._commit(k, reps[self.members[0]]["loss"], reps)

    def _commit(self, k: int, loss: float, reps: dict[str, dict], check: bool = True) -> None:
        now = self.now()
        # catching up on steps a survivor committed before an abort is not a clean interval
        pace_ok = check and self.last_event_was_commit and self.last_commit_t is not None
        if self._end_due_episodes(k):  # recover_end just before the commit that ends the episode
            pace_ok = False
        self.committed = k
        self.losses[k] = loss
        self.emit("step", loss=loss, gen=self.gen)
        if pace_ok:
            self.intervals.append((len(self.members), now - self.last_commit_t))
        self.last_commit_t = now
        self.last_progress = time.monotonic()
        self.bar.update(1)
        if reps and check and k >= R.first_judged_step(self.gen_start_step):
            self._watch_stragglers({m: r for m, r in reps.items() if m in self.slot_map})
        if k >= self.total:
            self.phase = "finishing"
            self._check_finished()
            return
        self._fire_due(after_announce=False)

    def _check_finished(self) -> None:
        live = [m for m in self.members if self.workers[m].alive]
        if live and all(self.workers[m].done_sha for m in live):
            shas = {self.workers[m].done_sha for m in live}
            if len(shas) > 1:
                self.failure = f"members finished with different weights: {sorted(shas)}"
                return
            self.final_sha = shas.pop()
            self.phase = "finished"

    def fault_free_step_time(self) -> float | None:
        """The fault-free pace the metrics compare with: the median clean commit interval at
        the run's full training membership (keel.metrics.median_full_membership_interval_s)."""
        return median_full_membership_interval_s(self.intervals, len(self.training))

    # ------------------------------------------------------------------------- episode ends

    def _end_due_episodes(self, k: int | None) -> bool:
        """End every episode whose recovery is complete at this generation (or at step k)."""
        due = self.book.due(self.gen, k, self.now())
        for ep in due:
            self._end_episode(ep)
        return bool(due)

    def _end_episode(self, ep: Episode) -> None:
        ep.stage = Stage.ENDED
        t = self.gen_t.get(self.gen, {})
        detail: dict[str, Any] = {"downtime_s": self.now() - ep.t}
        if ep.t_detect is not None:
            detail["detect_s"] = ep.t_detect - ep.t
        if ep.end_gen == self.gen and ep.end_step is None and "announced" in t:
            detail["reform_s"] = t.get("abort_s", 0.0) + t.get("pg_s", 0.0)
            detail["ack_s"] = t.get("abort_s", 0.0)
            detail["state_s"] = t.get("state_s", 0.0)
            if "ready" in t:
                detail["redo_s"] = self.now() - t["ready"]
        detail["gen"] = self.gen
        self.emit_ep("recover_end", ep, **detail)
