"""The successor of a coordinator that died: functions of the Coordinator (core.py) on its
state (state.py). Its supervisor (runtime/supervisor.py, over link.py) starts it with the
dead one's `recover`; the Coordinator restores the state from the snapshot (snapshot.py).

A successor restores the dead one's state (snapshot.py), opens the `coordinator_loss` episode
(or carries on the one the injection opened: fault -> detect -> recover_start), and then:
- under `absorb`, ends the generation as if aborted: every live member rejoins (worker_link.py),
  sends again the step reports not yet committed, leaves its generation and says so; the next
  generation is announced from the newest step some member committed (committed once every
  member holds it: generations.adopt), on the same slot map unless someone was lost meanwhile. A member that does not rejoin in time is lost, as
  one that does not leave an aborted generation always is. The episode ends at the new
  generation's first commit (its `ack_s`: from the death to that announcement).
- under `checkpoint_restart`, relaunches every worker from the newest checkpoint, as torchrun
  does when its rendezvous is lost (keel.recovery.action_for).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from keel.fault_classes import COORDINATOR

from runtime.coordinator import faults, snapshot
from runtime.coordinator.episodes import Stage
from runtime.coordinator.procs import SupervisedProcess
from runtime.coordinator.state import JOIN_TIMEOUT_S, Phase

if TYPE_CHECKING:
    from runtime.coordinator.core import Coordinator


def begin(c: Coordinator) -> None:
    """Carry the run on: log the deaths no predecessor logged, then end the generation the
    dead one left (module docstring)."""
    st = c.state
    rec = c.recover
    live = {int(pid) for pid in rec["workers"].values()}
    c.sup.exits.update({int(pid): rc for pid, rc in rec["exited"].items()})
    for w in st.workers.values():
        w.chan = None
        if w.pid in live or w.pid in c.sup.exits:
            w.proc = SupervisedProcess(c.sup, w.pid)
    first = ep = None
    for death in rec["deaths"]:  # those no predecessor logged (one died before it could)
        if death["n"] <= st.deaths_logged:
            continue
        noticed = max(0.0, (float(death["noticed"]) - st.t0) / c.scale)  # monotonic is machine-wide
        first = noticed if first is None else first
        ep = next((e for e in st.book if e.target == COORDINATOR and e.stage == Stage.STRUCK), None)
        if ep is None:  # nobody injected this: a real death (or a hang the supervisor ended)
            ep = c.new_episode("coordinator_loss", COORDINATOR, t=noticed, mode="external", how=death["how"])
        ep.detect(noticed)
        c.emit_ep("detect", ep, t=noticed, how=death["how"], detect_s=noticed - ep.t, death=death["n"])
        ep.start_recovery(c.now())
        c.emit_ep("recover_start", ep, gen=st.gen, incarnation=c.incarnation, pid=os.getpid(),
                  start_s=c.now() - noticed)
        st.deaths_logged = death["n"]
    was = st.phase
    if was == Phase.FINISHED:
        return
    if c.policy.kind == "checkpoint_restart" and was != Phase.FINISHING and ep is not None:
        st.enter(Phase.RUNNING)  # faults.restart relaunches from any phase but its own
        faults.restart(c, ep, decided=successor_up(c, ep.t))
        st.book.end_with_generation(st.gen + 1)
        return
    st.succeeding = True
    st.gen += 1  # past any generation the dead one may have announced without saving it
    st.t_abort = first if first is not None else c.now()  # abort_s: from the death to the next announcement
    now = time.monotonic()
    if was in (Phase.JOINING, Phase.RESTARTING):  # no generation yet: every live worker (re)joins
        for w in st.workers.values():
            w.joined = False
        st.enter(Phase.JOINING)
        st.join_deadline = now + JOIN_TIMEOUT_S
        st.book.end_with_generation(st.gen + 1)
        return
    st.enter(Phase.ABORTING)
    st.pending_acks = {m for m in st.members if st.workers[m].alive}
    st.abort_deadline = now + c.abort_wait_s() + snapshot.REJOIN_GRACE_S


def on_rejoin(c: Coordinator, chan: Any, msg: dict[str, Any]) -> str | None:
    """A worker of the dead coordinator's; its node, or None if not taken back (one this
    coordinator counts lost, or whose node is connected already)."""
    st = c.state
    node = msg.get("node")
    w = st.workers.get(node) if isinstance(node, str) else None
    rejoin = msg["rejoin"]
    if w is None or not w.alive or w.chan is not None or not isinstance(rejoin, dict):
        return None
    w.chan = chan
    w.joined = True
    w.last_seen = time.monotonic()
    w.committed = int(rejoin.get("committed") or 0)
    st.gen = max(st.gen, int(rejoin.get("gen", -1)))
    if not rejoin.get("in_gen"):
        st.pending_acks.discard(node)
    c.dirty = True
    return node


def successor_up(c: Coordinator, death: float) -> float | None:
    """Emulated, the moment the scenario has a dead coordinator's successor up: its death +
    `policy.coordinator_restart_s`, as the twin times it. A standby here is up sooner (a few
    tens of ms), so it waits for that moment: a relaunch decided then goes from the checkpoints
    published by then, as on the cluster (sweep member 3/18, 7 Dec: decided 0.2 s after the
    death against the scenario's 1.0 s, it relaunched from a write that ended 1.7 s after the
    death, which the twin's relaunch broke). Up later than that (this machine slower than the
    cluster), the decision is stamped then all the same, `restart_s` absorbing the real work as
    a relaunch's always does, and how late is counted (emulation `successor_late_s`). None
    outside an emulation: the successor decides when it is up."""
    if not c.emulated:
        return None
    up = death + c.policy.coordinator_restart_s
    wait_s = (up - c.now()) * c.scale
    if wait_s > 0:
        c.sup.in_background(lambda: time.sleep(wait_s))
    else:
        es = c.state.emu_stats
        es["successor_late_s"] = max(es.get("successor_late_s", 0.0), -wait_s / c.scale)
    return up
