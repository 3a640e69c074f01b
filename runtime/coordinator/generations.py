"""Generations and commits: joining, announcing a generation, planning the next after an abort
(planning.plan_generation), committing steps as every member reports them, and ending the
episodes whose recovery a generation or a commit completes. Functions of the Coordinator
(core.py) on its state (state.py); the abort itself is `Coordinator.abort` (faults end
generations too).

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
from typing import TYPE_CHECKING

from keel import recovery as R

from runtime.coordinator import faults
from runtime.coordinator.planning import Loss, View, WorkerView, initial_slot_map, plan_generation
from runtime.coordinator.state import JOIN_TIMEOUT_S, Phase
from runtime.inject import jitter_schedule

if TYPE_CHECKING:
    from runtime.coordinator.core import Coordinator

RELAUNCH_TOLERANCE = 0.05  # a relaunch announced later than this fraction of restart_s after its
                           # emulated end outran it: an unfaithful emulation (docs/emulation.md)


# ----------------------------------------------------------------------------- the view

def view(c: Coordinator) -> View:
    """What the slot planner needs to know, as plain data."""
    st = c.state
    losses = {}
    for n in st.slot_map:
        ep = st.book.of_killed(n)
        if ep is not None:
            losses[n] = Loss(ep.fault_id, ep.action, ep.target)
    workers = {n: WorkerView(alive=w.alive, joined=w.joined, committed=w.committed,
                             parked=tuple(w.parked) if w.parked is not None else None,
                             per_slot_s=st.watch.per_slot.get(n))
               for n, w in st.workers.items()}
    return View(nodes=tuple(c.nodes), region_speed={r.name: r.speed for r in c.sc.regions},
                slot_map={m: tuple(s) for m, s in st.slot_map.items()}, workers=workers,
                committed=st.committed, to_park=dict(st.to_park), to_unpark=dict(st.to_unpark),
                losses=losses)


# ----------------------------------------------------------------------------- joining

def check_joined(c: Coordinator) -> None:
    st = c.state
    expected = [n for n in c.nodes if n in st.workers and st.workers[n].alive] if c.spawn_local else c.nodes
    if all(n in st.workers and st.workers[n].joined for n in expected) and expected:
        _initial_generation(c)
    elif c.spawn_local and not expected:
        # every process this run started died before joining: nothing will ever join
        st.failure = (f"every worker process exited before joining the run (their output: "
                      f"{c.out / 'logs'})")
    elif time.monotonic() > st.join_deadline:
        missing = [n for n in expected if not (n in st.workers and st.workers[n].joined)]
        st.failure = f"workers did not join within {JOIN_TIMEOUT_S:.0f} s: {', '.join(missing)}"


def _initial_generation(c: Coordinator) -> None:
    st = c.state
    st.slot_map = initial_slot_map(view(c), len(c.training), c.sc.slot_count)
    for w in st.workers.values():
        if w.alive:
            w.committed = 0
    announce(c, load=st.load_path, start=st.committed, force_broadcast=st.load_path is not None)
    st.load_path = None


# ----------------------------------------------------------------------------- generations

def state_source(c: Coordinator, live_members: list, start: int, force_broadcast: bool) -> int:
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
    regions = list(dict.fromkeys(c.region_of[live_members[i].node] for i in fresh))
    pick = R.state_source_region(regions, [c.region_of[live_members[i].node] for i in behind],
                                 lambda a, b: message_latency_s(c.sc, a, b))
    return next(i for i in fresh if c.region_of[live_members[i].node] == pick)


def announce(c: Coordinator, *, load: str | None, start: int, force_broadcast: bool = False) -> None:
    st = c.state
    st.gen += 1
    st.succeeding = False
    st.members = sorted(st.slot_map, key=c.order.get)
    live_members = [st.workers[m] for m in st.members]
    source = state_source(c, live_members, start, force_broadcast)
    behind = [i for i, w in enumerate(live_members) if i != source and (force_broadcast or w.committed != start)]
    st.reports = {k: v for k, v in st.reports.items() if k <= start}
    st.nonfinite = {}
    base = {"type": "gen", "gen": st.gen, "world": len(st.members), "members": st.members,
            "slot_map": st.slot_map, "start_step": start, "source": source, "behind": behind,
            "load": load, "quarantine": sorted(st.quarantine), "poison": c.poison,
            "jitter": jitter_schedule(c.planned, start), "not_before": st.not_before}
    st.gen_t.setdefault(st.gen, {})["announced"] = c.now()
    if c.emulated and st.not_before > 0:  # a relaunch (checkpoint_restart): restart_s is emulated,
        # and the real stop, checkpoint check and fork must fit in it for the emulation to hold
        late = c.now() - st.not_before
        es = st.emu_stats
        es["relaunches"] = es.get("relaunches", 0) + 1
        es["relaunch_late_s"] = max(es.get("relaunch_late_s", 0.0), late)
        if late > RELAUNCH_TOLERANCE * c.policy.restart_s:
            es["relaunch_overruns"] = es.get("relaunch_overruns", 0) + 1
        st.not_before = 0.0  # counted once: the workers have it in this announcement
    st.watch.new_generation(st.members)
    for rank, m in enumerate(st.members):
        w = st.workers[m]
        w.role = "member"
        w.chan.send({**base, "rank": rank, "slots": st.slot_map[m]})
    for w in st.workers.values():
        if w.alive and w.joined and w.node not in st.slot_map:
            w.role = "standby"
            if w.chan is not None:
                w.chan.send({"type": "standby", "gen": st.gen})
    st.gen_start_step = start
    st.last_progress = time.monotonic()
    if start >= c.total:
        # a generation formed after the last step (a straggler moving back, a loss at the
        # very end): its members only sync state and report done; nothing is left to run
        _adopt_steps(c)
        _end_due_episodes(c, None)
        st.enter(Phase.FINISHING)
        check_finished(c)
        return
    st.enter(Phase.RUNNING)
    faults.fire_due(c, after_announce=True)


def next_generation(c: Coordinator) -> None:
    """The aborted generation's members have all left it: plan the next (planning.py), say
    where slots moved, announce it. It starts from the newest step a survivor committed,
    committed in turn once every member holds it (adopt)."""
    st = c.state
    plan = plan_generation(view(c))
    st.to_park, st.to_unpark = {}, {}
    for node in plan.unparked:
        st.workers[node].parked = None
        st.watch.back_in(node)
    for node, slots in plan.parked.items():
        st.workers[node].parked = slots
    if plan.failure:
        st.failure = plan.failure
        return
    # a step that some survivor committed before the abort starts the next generation; it is
    # committed once every member holds it (adopt)
    missing = [k for k in range(st.committed + 1, plan.start + 1) if not st.reports.get(k)]
    if missing:
        st.failure = f"step {missing[0]} committed by a survivor but its report is missing"
        return
    slot_map = plan.slot_map
    for fid, mv in sorted(plan.moves.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        ep = st.book.get(fid)
        detail = {"gen": st.gen + 1, "moves": [[s, a, b] for s, a, b in mv],
                  "slot_map": {m: slot_map[m] for m in sorted(slot_map, key=c.order.get)}}
        if ep is not None:
            c.emit_ep("reslot", ep, **detail)
        else:
            c.emit("reslot", action=R.ABSORB_ACTION["network_jitter"], **detail)
    st.slot_map = slot_map
    st.gen_t.setdefault(st.gen + 1, {})["abort_s"] = c.now() - st.t_abort
    st.book.end_with_generation(st.gen + 1)
    announce(c, load=None, start=plan.start)


# ----------------------------------------------------------------------------- commits

def adopt(c: Coordinator) -> None:
    """Once every member of the generation is ready (it holds the state the generation starts
    from), commit the steps up to its start that a survivor of the last one committed alone
    before the abort. Committed when announced, they were lost with that survivor if it was
    lost before it had sent them on, and the run failed with the state of a step it had
    committed gone (a partition of the one worker ahead, right after a coordinator's failover:
    tests/test_job_examples.py, 7 Dec); not yet committed, the generation after starts from
    the newest step a live worker holds."""
    st = c.state
    if (st.phase == Phase.RUNNING and st.committed < st.gen_start_step
            and all(st.workers[m].ready_gen >= st.gen for m in st.members)):
        _adopt_steps(c)
        try_commit(c)


def _adopt_steps(c: Coordinator) -> None:
    st = c.state
    while st.committed < st.gen_start_step:
        k = st.committed + 1
        commit(c, k, next(iter(st.reports[k].values()))["loss"], {}, check=False, adopted=True)


def try_commit(c: Coordinator) -> None:
    st = c.state
    while st.phase == Phase.RUNNING:
        k = st.committed + 1
        reps = st.reports.get(k)
        if not reps or any(m not in reps for m in st.members):
            return
        losses = {repr(reps[m]["loss"]) for m in st.members}
        if len(losses) > 1:
            st.failure = f"members disagree on the loss of step {k}: {sorted(losses)} (non-deterministic reduction?)"
            return
        commit(c, k, reps[st.members[0]]["loss"], reps)


def commit(c: Coordinator, k: int, loss: float, reps: dict[str, dict], check: bool = True,
           adopted: bool = False) -> None:
    """Commit step k. `adopted`: a step of the last generation's (adopt), which ends only the
    episodes due at that step, not those the current generation's first commit ends."""
    st = c.state
    now = c.now()
    # catching up on steps a survivor committed before an abort is not a clean interval
    pace_ok = check and st.last_event_was_commit and st.last_commit_t is not None
    if _end_due_episodes(c, k, st.gen - 1 if adopted else None):  # recover_end just before the commit
        pace_ok = False                                             # that ends the episode
    st.committed = k
    st.losses[k] = loss
    c.emit("step", loss=loss, gen=st.gen)
    if pace_ok:
        st.intervals.append((len(st.members), now - st.last_commit_t))
    st.last_commit_t = now
    st.last_progress = time.monotonic()
    c.bar.update(1)
    if reps and check and k >= R.first_judged_step(st.gen_start_step):
        # in the members' (scenario) order, not the reports' arrival order: the verdict on a
        # step is the twin's to predict (keel.recovery.judge_step parks the first one slow)
        faults.watch_stragglers(c, {m: reps[m] for m in st.members if m in reps and m in st.slot_map})
    if k >= c.total:
        st.enter(Phase.FINISHING)
        check_finished(c)
        return
    faults.fire_due(c, after_announce=adopted)


def check_finished(c: Coordinator) -> None:
    st = c.state
    live = [m for m in st.members if st.workers[m].alive]
    if live and all(st.workers[m].done_sha for m in live):
        shas = {st.workers[m].done_sha for m in live}
        if len(shas) > 1:
            st.failure = f"members finished with different weights: {sorted(shas)}"
            return
        st.final_sha = shas.pop()
        st.enter(Phase.FINISHED)


def _end_due_episodes(c: Coordinator, k: int | None, gen: int | None = None) -> bool:
    """End every episode whose recovery is complete at this generation (or `gen`), or at step k."""
    due = c.state.book.due(c.state.gen if gen is None else gen, k, c.now())
    for ep in due:
        c.end_episode(ep)
    return bool(due)
