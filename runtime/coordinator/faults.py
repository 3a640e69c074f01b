"""Faults and their episodes: firing the scheduled injections when their step is committed,
noticing a lost worker, judging stragglers, quarantining a bad shard, and the
`checkpoint_restart` baseline: functions of the Coordinator (core.py) on its state (state.py).
Each fault is an episode in the book (episodes.py); its events
follow fault -> detect -> recover_start -> reslot -> recover_end (the first commit of the new
generation); data faults add `quarantine`; `checkpoint_restart` adds `restart`.

Scheduled faults fire when `at_step` steps are committed; a fault whose step is reached while
another is being recovered fires as soon as the new generation is announced (so schedule two
faults at one step to hit a recovery). A fault that finds nothing to strike (its node or every
node of its region already down, its shard already quarantined) opens no episode, as in the
twin; a spike whose nodes are all lost ends at the next commit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from keel import recovery as R

from runtime.checkpoint_format import STEP_DIR
from runtime.coordinator import injections
from runtime.coordinator.episodes import Episode, Stage
from runtime.coordinator.state import JOIN_TIMEOUT_S, Phase
from runtime.inject import Planned

if TYPE_CHECKING:
    from runtime.coordinator.core import Coordinator
    from runtime.coordinator.workers import WorkerState


def check_planned(planned: list[Planned]) -> None:
    """Import each scheduled fault's runtime module now, not at the commit that fires it: an
    unknown class fails here."""
    for p in planned:
        injections.module(p.cls)


# ----------------------------------------------------------------------------- injections

def fire_due(c: Coordinator, after_announce: bool) -> None:
    """Fire the scheduled faults that are due; at most one that kills or hangs a worker
    per decision point, so a second one at the same step lands during the recovery."""
    st = c.state
    while st.fired < len(c.planned) and st.phase == Phase.RUNNING:
        p = c.planned[st.fired]
        if p.at_step > st.committed:
            return
        if p.at_step < st.start_step:  # before the checkpoint we resumed from
            st.fired += 1
            continue
        if p.mode in injections.NODE_LOSS_MODES and not after_announce and st.book.node_recovery_under_way(st.slot_map):
            return  # it will land during the recovery, once the new generation is announced
        st.fired += 1
        if fire(c, p, st.fired - 1):
            return


def fire(c: Any, p: Planned, planned: int) -> bool:
    """Perform `p` by its class's injection (injections/<class>.py); True where it killed
    or stopped a worker. `planned` is its place in c.planned: a successor replays it as
    fired (snapshot.py)."""
    return injections.module(p.cls).fire(c, p, planned)


# ----------------------------------------------------------------------------- a lost worker

def lost(c: Coordinator, w: WorkerState, how: str) -> None:
    st = c.state
    if not w.alive:
        return
    last_seen = w.last_seen
    w.alive = False
    w.role = "dead"
    if w.proc is not None and w.proc.poll() is None:
        w.proc.signal(signal.SIGKILL)  # fence: a hung worker never comes back
    c.drop_channel(w)
    st.pending_acks.discard(w.node)
    if st.phase in (Phase.FINISHING, Phase.FINISHED, Phase.RESTARTING):
        return
    spike = st.book.jitter_on(w.node)
    if spike is not None and not any(c.live(n) for n in spike.nodes):
        # nothing of the spike is left to sit out or move back: it ends at the next commit
        spike.parked = False
        if spike.stage == Stage.DETECTED:
            spike.stage = Stage.RECOVERING
        if spike.recovering and spike.end_gen is None:
            spike.end_gen = st.gen
    ep = st.book.of_killed(w.node)
    if ep is None:  # nobody injected this: a real failure
        ep = c.new_episode("hardware_fault", w.node, t=max(0.0, (last_seen - st.t0) / c.scale),
                           nodes=[w.node], mode="external")
        st.book.killed[w.node] = ep.fault_id
    now = c.now()
    ep.detect(now)
    c.emit_ep("detect", ep, node=w.node, how=how, detect_s=now - ep.t)
    was_member = w.node in st.slot_map and st.phase in (Phase.RUNNING, Phase.ABORTING)
    if st.phase == Phase.JOINING:
        return
    if c.policy.kind == "checkpoint_restart":
        if was_member:
            restart(c, ep)
        return
    if not was_member:  # a spare or a parked straggler: nothing to re-form
        w.parked = None
        if not ep.member_lost and not ep.ended and all(not st.workers[n].alive for n in ep.nodes):
            ep.stage = Stage.RECOVERING
            c.emit_ep("recover_start", ep, gen=st.gen, lost=[w.node], spare=True)
            c.end_episode(ep)
        return
    ep.member_lost = True
    if ep.start_recovery():
        c.emit_ep("recover_start", ep, gen=st.gen, lost=[w.node])
    c.abort()


# ----------------------------------------------------------------------------- stragglers

def watch_stragglers(c: Coordinator, reps: dict[str, dict]) -> None:
    """Apply the straggler watch's verdicts on one committed step to the spikes' episodes."""
    st = c.state
    may_park = c.policy.kind == "absorb" and len(st.slot_map) > 1
    judged: dict[int, tuple[Episode, bool]] = {}  # the spikes on judged members: any of them slow?
    for v in st.watch.judge(reps, may_park):
        ep = st.book.jitter_on(v.node)
        if ep is not None:
            judged[ep.fault_id] = (ep, v.slow or (ep.fault_id in judged and judged[ep.fault_id][1]))
        if v.slow:
            if ep is not None and ep.detect(c.now()):
                c.emit_ep("detect", ep, node=v.node, how="slow steps", per_slot_s=v.per_slot_s,
                          median_per_slot_s=v.median_per_slot_s)
            if v.park:
                if ep is not None and ep.start_recovery():
                    ep.parked = True
                    c.emit_ep("recover_start", ep, node=v.node, gen=st.gen)
                st.to_park[v.node] = ep.fault_id if ep is not None else None
                c.abort()
                return
    for ep, any_slow in judged.values():  # detected but never moved: over once fine for a window
        if ep.stage == Stage.DETECTED:
            ep.ok, over = R.spike_settled(ep.ok, any_slow, c.policy.straggler_window)
            if over:
                ep.stage = Stage.RECOVERING
                c.end_episode(ep)


def probe(c: Coordinator, w: WorkerState, probe_s: float) -> None:
    """A parked straggler's measured communication delay; back in once it would no longer
    be a straggler for `straggler_window` heartbeats in a row."""
    st = c.state
    if st.watch.probe(w.node, probe_s) and st.phase == Phase.RUNNING and w.node not in st.to_unpark:
        ep = st.book.jitter_on(w.node)
        if ep is not None:
            ep.parked = False
            ep.end_gen = st.gen + 1
        st.to_unpark[w.node] = ep.fault_id if ep is not None else None
        c.abort()


# ----------------------------------------------------------------------------- quarantine

def try_nonfinite(c: Coordinator, step: int) -> None:
    st = c.state
    got = st.nonfinite.get(step, {})
    if any(m not in got for m in st.members):
        return
    suspects = sorted({s for v in got.values() for s in v})
    ep = st.book.bad_shard(suspects)
    if ep is None:
        ep = c.new_episode("data_shard_skew", f"shard/{suspects[0]}" if suspects else "shard/?", mode="external")
    now = c.now()
    ep.detect(now)
    c.emit_ep("detect", ep, step_index=step, shards=suspects, how="non-finite reduced gradient")
    if not suspects:
        st.failure = f"step {step + 1}: non-finite gradient not attributable to a data shard"
        return
    if ep.action == R.FAIL_ACTION:
        st.failure = f"step {step + 1}: shard(s) {suspects} yield non-finite values and policy.quarantine is false"
        return
    new = set(suspects) - st.quarantine
    st.quarantine |= set(suspects)
    if ep.start_recovery():
        c.emit_ep("recover_start", ep, gen=st.gen)
    c.emit_ep("quarantine", ep, shards=sorted(new or suspects), quarantine=sorted(st.quarantine),
              step_index=step)
    if c.policy.kind == "checkpoint_restart":
        restart(c, ep)
        return
    ep.end_step = step + 1
    st.nonfinite.pop(step, None)
    for m in st.members:
        st.workers[m].chan.send({"type": "quarantine", "gen": st.gen, "step": step,
                                 "shards": sorted(st.quarantine)})


# ----------------------------------------------------------------------------- checkpoint_restart

def published_steps(ckpt_dir) -> list[int]:
    """The steps whose checkpoint is published (renamed into place) in `ckpt_dir` now."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for n in names if (m := STEP_DIR.match(n))]


def restart(c: Coordinator, ep: Episode, decided: float | None = None) -> None:
    """The baseline: stop every worker, relaunch them all, load the newest checkpoint published
    when the relaunch was decided (`decided`, emulated: now, or when the scenario has a dead
    coordinator's successor up, succession.successor_up)."""
    decided = c.now() if decided is None else decided  # emulated: the relaunch's restart_s runs from
    # the decision (below), taken before anything here costs real time: the first import of
    # runtime.checkpoint (torch) took ~0.9 s of wall, which an emulated relaunch added to
    # restart_s (sweep member 1/9, 6 Dec). The checkpoints are listed then too: one published
    # during that import (an async write ending) is one whose writer the relaunch kills on the
    # cluster, and the twin breaks it; relaunched from, it put the run 4 steps ahead of the
    # twin's (sweep member 3/18, 7 Dec)
    published = published_steps(c.ckpt_dir)
    from runtime import checkpoint as ck
    st = c.state
    if st.phase == Phase.RESTARTING:
        return
    if not c.spawn_local:
        st.failure = "policy checkpoint_restart needs workers spawned by keel run"
        return
    st.enter(Phase.RESTARTING)
    st.restarts += 1
    # a checkpoint of a step not committed here (written by workers while a dead
    # coordinator's successor was starting) is not one this run has reached. Verifying
    # reads and hashes every file: in the background, so that a large checkpoint is not
    # taken for a hung coordinator (link.SupervisorLink.in_background)
    at_most = min(st.committed, max(published, default=0))
    latest = c.sup.in_background(lambda: ck.find_latest(c.ckpt_dir, at_most=at_most))
    step = int(latest.name.split("-")[1]) if latest is not None else 0
    c.emit_ep("restart", ep, from_step=step, checkpoint=str(latest) if latest else None,
              lost_steps=st.committed - step)
    ep.stage = Stage.RECOVERING
    for w in st.workers.values():
        if w.alive:
            w.alive = False
            if w.proc is not None:
                w.proc.signal(signal.SIGKILL)
        c.drop_channel(w)
    for w in st.workers.values():
        if w.proc is not None:
            try:
                w.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
    st.committed = step
    st.start_step = min(st.start_step, step)
    st.reports = {}
    st.load_path = str(latest) if latest is not None else None
    st.gen_t[st.gen + 1] = {"abort_s": 0.0}
    # a relaunch: fresh interpreters pay the real import and start-up; an emulated cluster
    # forks its workers (fast) and starts the generation policy.restart_s emulated seconds
    # after the decision: the real work since (verifying the checkpoint, stopping every
    # worker, forking the new ones) is the test bed's stand-in for the relaunch restart_s
    # describes, absorbed by it as every emulated duration absorbs the real work it stands
    # for (issue 25: counted on top, it added 14 s to a 18.4 s relaunch at time scale 0.07)
    st.not_before = decided + c.policy.restart_s if c.emulated else 0.0
    # the machines that are up: a node whose machine crashed (emulated) and held slots hands its
    # place to a free spare, or a new machine takes it under its name, as the twin decides
    down = {n for n in c.nodes if n in st.workers and st.workers[n].machine_down}
    orphans = [n for n in c.nodes if n in down and n in st.slot_map]
    free = [n for n in c.nodes[len(c.training):] if n not in down and n not in st.slot_map]
    _, new_machines = R.relaunch_places(orphans, free)
    for n in c.nodes:
        if n not in down or n in new_machines:
            c.spawn(n, fresh_interpreter=not c.emulated)
    ep.end_gen = st.gen + 1
    st.enter(Phase.JOINING)
    st.join_deadline = time.monotonic() + JOIN_TIMEOUT_S
