"""A coordinator under a supervisor (runtime/supervisor.py), and the successor of one that died
(a mixin of runtime.coordinator.core.Coordinator).

Under a supervisor the coordinator asks it to start workers (`spawn`), hears of their exits
(`exited`), and says `hb` every HB_S so that a hung coordinator is found.

A successor restores the dead one's state (snapshot.py), opens the `coordinator_loss` episode
(or carries on the one the injection opened: fault -> detect -> recover_start), and then:
- under `absorb`, ends the generation as if aborted: every live member rejoins (worker_link.py),
  sends again the step reports not yet committed, leaves its generation and says so; the steps
  some member committed are committed and the next generation is announced, on the same slot
  map unless someone was lost meanwhile. A member that does not rejoin in time is lost, as
  one that does not leave an aborted generation always is. The episode ends at the new
  generation's first commit (its `ack_s`: from the death to that announcement).
- under `checkpoint_restart`, relaunches every worker from the newest checkpoint, as torchrun
  does when its rendezvous is lost (keel.recovery.action_for).
"""
from __future__ import annotations

import os
import select
import threading
import time
from typing import Any, Callable, TypeVar

from keel.fault_classes import COORDINATOR

from runtime.coordinator import snapshot
from runtime.coordinator.episodes import Stage
from runtime.coordinator.generations import JOIN_TIMEOUT_S
from runtime.coordinator.procs import SupervisedProcess

HB_S = 0.5
T = TypeVar("T")


class SuccessionMixin:
    def init_succession(self, link: Any, recover: dict[str, Any] | None, incarnation: int) -> None:
        self.link = link
        self.recover = recover
        self.incarnation = incarnation
        self.succeeding = False   # between a successor's start and its first announcement
        self.dirty = False        # something the snapshot holds changed this loop turn
        self.dirty_commits = False  # steps were committed since the last snapshot (the log has them)
        self.saved_t = 0.0
        self.exits: dict[int, int | None] = {}   # worker pid -> exit code, as the supervisor says
        self.spawned: dict[str, int] = {}
        self.link_hb = 0.0
        self.deaths_logged = -1   # the supervisor's number of the last coordinator death logged
        if recover is not None:
            snapshot.restore(self, snapshot.load(self.out))

    # ------------------------------------------------------------------------- the supervisor

    def on_link(self) -> None:
        msgs = self.link.recv_ready()
        if msgs is None:
            self.failure = "the supervisor (keel run) is gone"
            return
        for msg in msgs:
            if msg.get("type") == "exited":
                self.exits[int(msg["pid"])] = msg.get("rc")
            elif msg.get("type") == "spawned":
                self.spawned[str(msg["node"])] = int(msg["pid"])

    def link_beat(self) -> None:
        now = time.monotonic()
        if self.link is not None and now - self.link_hb > HB_S:
            self.link_hb = now
            self.link.send({"type": "hb"})

    def link_wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """Serve the supervisor's link until `done()` or `timeout` seconds; done()."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.link is None:
                return done()
            self.link_beat()
            ready, _, _ = select.select([self.link.sock], [], [], min(left, 0.05))
            if ready:
                self.on_link()
                if self.failure:
                    return done()
        return True

    def in_background(self, fn: Callable[[], T]) -> T:
        """fn() in a thread of its own while this one keeps serving the supervisor's link (and
        saying hb): a long synchronous operation, such as verifying a large checkpoint, is not
        taken for a hang. Without a supervisor, fn() here. Its exception is raised here."""
        if self.link is None:
            return fn()
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # raised again in the caller's thread
                out["error"] = e
        t = threading.Thread(target=call, name="keel-coordinator-io", daemon=True)
        t.start()
        self.link_wait(lambda: not t.is_alive(), float("inf"))
        t.join()  # the link may have failed first: the operation still ends before we go on
        if "error" in out:
            raise out["error"]
        return out["value"]

    def supervised_spawn(self, node: str, fresh: bool) -> SupervisedProcess:
        self.spawned.pop(node, None)
        self.link.send({"type": "spawn", "node": node, "fresh": fresh})
        if not self.link_wait(lambda: node in self.spawned, 120.0):
            raise RuntimeError(f"the supervisor did not start the worker of {node}")
        return SupervisedProcess(self, self.spawned.pop(node))

    # ------------------------------------------------------------------------- a successor

    def begin_succession(self) -> None:
        rec = self.recover
        live = {int(pid) for pid in rec["workers"].values()}
        self.exits.update({int(pid): rc for pid, rc in rec["exited"].items()})
        for w in self.workers.values():
            w.chan = None
            if w.pid in live or w.pid in self.exits:
                w.proc = SupervisedProcess(self, w.pid)
        first = ep = None
        for death in rec["deaths"]:  # those no predecessor logged (one died before it could)
            if death["n"] <= self.deaths_logged:
                continue
            noticed = max(0.0, (float(death["noticed"]) - self.t0) / self.scale)  # monotonic is machine-wide
            first = noticed if first is None else first
            ep = next((e for e in self.book if e.target == COORDINATOR and e.stage == Stage.STRUCK), None)
            if ep is None:  # nobody injected this: a real death (or a hang the supervisor ended)
                ep = self._new_episode("coordinator_loss", COORDINATOR, t=noticed, mode="external", how=death["how"])
            ep.detect(noticed)
            self.emit_ep("detect", ep, t=noticed, how=death["how"], detect_s=noticed - ep.t, death=death["n"])
            ep.start_recovery(self.now())
            self.emit_ep("recover_start", ep, gen=self.gen, incarnation=self.incarnation, pid=os.getpid(),
                         start_s=self.now() - noticed)
            self.deaths_logged = death["n"]
        was = self.phase
        if was == "finished":
            return
        if self.policy.kind == "checkpoint_restart" and was != "finishing" and ep is not None:
            self.phase = "running"  # _restart relaunches from any phase but its own
            self._restart(ep)
            self.book.end_with_generation(self.gen + 1)
            return
        self.succeeding = True
        self.gen += 1  # past any generation the dead one may have announced without saving it
        self.t_abort = first if first is not None else self.now()  # abort_s: from the death to the next announcement
        now = time.monotonic()
        if was in ("joining", "restarting"):  # no generation yet: every live worker (re)joins
            for w in self.workers.values():
                w.joined = False
            self.phase = "joining"
            self.join_deadline = now + JOIN_TIMEOUT_S
            self.book.end_with_generation(self.gen + 1)
            return
        self.phase = "aborting"
        self.pending_acks = {m for m in self.members if self.workers[m].alive}
        self.abort_deadline = now + self._abort_wait_s() + snapshot.REJOIN_GRACE_S

    def on_rejoin(self, chan: Any, msg: dict[str, Any]) -> str | None:
        """A worker of the dead coordinator's; its node, or None if not taken back (one this
        coordinator counts lost, or whose node is connected already)."""
        node = msg.get("node")
        w = self.workers.get(node) if isinstance(node, str) else None
        rejoin = msg["rejoin"]
        if w is None or not w.alive or w.chan is not None or not isinstance(rejoin, dict):
            return None
        w.chan = chan
        w.joined = True
        w.last_seen = time.monotonic()
        w.committed = int(rejoin.get("committed") or 0)
        self.gen = max(self.gen, int(rejoin.get("gen", -1)))
        if not rejoin.get("in_gen"):
            self.pending_acks.discard(node)
        self.dirty = True
        return node
