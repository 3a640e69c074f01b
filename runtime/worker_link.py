"""A worker's control connection, kept across its coordinator's restarts.

The coordinator may die and a successor take its place at the same address (runtime/
supervisor.py keeps the port). When the connection closes, the worker goes on training and
tries to rejoin: it answers the successor's challenge with a hello that carries `rejoin`
(where it stands: generation, committed step, whether it is still in a generation), and the
welcome tells it the step the successor has committed. The worker then sends again the step
reports the successor has not committed (the history is kept until a heartbeat says they are
committed), then what it could not send meanwhile, then leaves its generation: the successor
forms the next one. A worker that finds no coordinator within `silence_s` of the last message
it heard, or is refused, gives up (exit 3): no worker outlives its job.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable

from runtime.protocol import (COMMIT_LEAD_STEPS, COORDINATOR_SILENCE_S, Channel, ProtocolError, env_secret,
                              hello_mac, parse_address)

RETRY_S = 0.05  # between attempts to reach a successor


class Refused(Exception):
    """The coordinator answered, but does not admit this worker (its reason)."""


def handshake(address: str, hello: dict[str, Any], timeout: float) -> tuple[Channel, dict[str, Any]]:
    """Connect to the coordinator at `address`, answer its challenge with `hello` and the job's
    secret (KEEL_JOB_SECRET); its welcome. Raises Refused, ProtocolError or OSError."""
    host, port = parse_address(address)
    sock = socket.create_connection((host, port), timeout=timeout)
    chan = Channel(sock)
    try:
        challenge = chan.recv()
        if challenge is None or challenge.get("type") != "challenge":
            raise ProtocolError(f"no challenge from the coordinator at {address} (got {challenge!r})")
        chan.send({**hello, "type": "hello", "pid": os.getpid(), "host": socket.gethostname(),
                   "mac": hello_mac(env_secret() or "", str(challenge.get("nonce")))})
        welcome = chan.recv()
    except BaseException:
        chan.close()
        raise
    if welcome is None or welcome.get("type") != "welcome":
        chan.close()
        raise Refused((welcome or {}).get("reason", "the connection closed"))
    sock.settimeout(float(welcome.get("silence_s") or COORDINATOR_SILENCE_S))  # silent that long: gone
    return chan, welcome


class Unconfirmed(RuntimeError):
    """A checkpoint left unpublished: the coordinator never confirmed its step."""


class CoordinatorLink:
    """What the worker sends and reads through, whichever coordinator is there. `send` never
    fails: while no coordinator is connected, messages (not heartbeats) wait and go to the
    next one; step reports are also kept until a heartbeat says they are committed."""

    def __init__(self, address: str, chan: Channel, silence_s: float):
        self.address = address
        self.chan = chan
        self.silence_s = silence_s
        self.connected = True
        self.last_heard = time.monotonic()
        self.pending: list[dict[str, Any]] = []
        self.reports: dict[int, dict[str, Any]] = {}  # step -> report, not yet known to be committed
        self.confirmed = 0  # the newest step a coordinator said it committed (or a generation starts at)
        self.confirmed_at = time.monotonic()  # when it said so
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> bool:
        with self._lock:
            if msg.get("type") == "step":
                self.reports[int(msg["step"])] = msg
            if self.connected and self.chan.send(msg):
                return True
            self.connected = False
            if msg.get("type") not in ("hb", "step"):  # reports go again from `reports`
                self.pending.append(msg)
            return True

    def recv(self) -> dict[str, Any] | None:
        """The next message from the coordinator; None when it is gone (closed, or silent
        for `silence_s`). Heartbeats carrying `committed` prune the report history."""
        try:
            msg = self.chan.recv()
        except ProtocolError:
            msg = None
        if msg is None:
            with self._lock:
                self.connected = False
            return None
        self.last_heard = time.monotonic()
        if msg.get("type") == "hb" and isinstance(msg.get("committed"), int):
            self.confirm(msg["committed"])
            with self._lock:
                for k in [k for k in self.reports if k <= msg["committed"]]:
                    del self.reports[k]
        return msg

    def confirm(self, step: int) -> None:
        if step > self.confirmed:
            self.confirmed, self.confirmed_at = step, time.monotonic()

    def await_confirmed(self, step: int, give_up: Callable[[], bool]) -> None:
        """Return once the coordinator has confirmed `step`: a checkpoint of it may then be
        published (runtime/protocol.py). Unconfirmed if `give_up()` turns true first."""
        while self.confirmed < step:
            if give_up():
                raise Unconfirmed(f"not published: the coordinator has not confirmed step {step} "
                                  f"(its last word confirmed step {self.confirmed})")
            time.sleep(0.002)

    def may_commit(self, step: int) -> bool:
        """Whether this worker may commit `step`: its coordinator has confirmed a step at most
        COMMIT_LEAD_STEPS before it (runtime/protocol.py)."""
        return step <= self.confirmed + COMMIT_LEAD_STEPS

    def rejoin(self, hello: Callable[[], dict[str, Any]], stopping: Callable[[], bool]) -> dict[str, Any] | None:
        """Reach a successor at the same address before `silence_s` since the last message
        heard; its welcome, or None (gone for good, or refused). The reports it has not
        committed and the messages that waited are sent to it, in order, before anything else."""
        while not stopping():
            left = self.last_heard + self.silence_s - time.monotonic()
            if left <= 0:
                return None
            try:
                chan, welcome = handshake(self.address, hello(), min(left, 5.0))
            except Refused as e:
                print(f"worker: the coordinator at {self.address} refused to take this worker back: {e}",
                      file=sys.stderr, flush=True)
                return None
            except (OSError, ProtocolError):
                time.sleep(RETRY_S)
                continue
            with self._lock:
                old, self.chan = self.chan, chan
                old.close()
                committed = int(welcome.get("committed", 0))
                self.confirm(committed)
                for k in sorted(self.reports):
                    if k > committed:
                        chan.send({**self.reports[k], "resent": True})
                for msg in self.pending:
                    chan.send(msg)
                self.pending = []
                self.connected = True
                self.last_heard = time.monotonic()
            return welcome
        return None

    def close(self) -> None:
        self.chan.close()


# ----------------------------------------------------------------------------- the worker's side
# Functions of the Worker (runtime/worker.py): its link (`chan`), its abort signal, its inbox.

def hold_commit(w, step: int, should_abort: Callable[[], bool]) -> None:
    """Commit `step` only once the coordinator has confirmed enough (CoordinatorLink.may_commit):
    wait for its word, or for the generation's abort. A coordinator that stays silent ends
    this process from the reader thread after `silence_s`, the step uncommitted."""
    from runtime.waiting import Aborted
    t0 = time.monotonic()
    said = False
    while not w.chan.may_commit(step):
        if should_abort():
            raise Aborted()
        if not said and time.monotonic() - t0 > 1.0:
            said = True
            print(f"worker {w.node}: holding step {step} uncommitted: the coordinator confirmed step "
                  f"{w.chan.confirmed}, its last word {time.monotonic() - w.chan.last_heard:.1f} s ago",
                  file=sys.stderr, flush=True)
        w.abort_event.wait(0.002)


def rejoin(w) -> bool:
    """Rejoin a successor coordinator (module docstring). What the dead one sent and this
    worker has not acted on is dropped; the generation it is in is left (the successor
    forms the next one), and so is any it may still find queued."""
    hello = lambda: {"node": w.node, "rejoin": {  # noqa: E731
        "gen": w.gen, "committed": w.committed, "in_gen": w.gen >= 0 and w.acked_gen < w.gen}}
    welcome = w.chan.rejoin(hello, lambda: w.stopping)
    if welcome is None:
        return False
    while True:
        try:
            w.inbox.get_nowait()
        except queue.Empty:
            break
    print(f"worker {w.node}: rejoined the coordinator (gen {w.gen}, step {w.committed})",
          file=sys.stderr, flush=True)
    w.abort(max(w.gen, int(welcome.get("gen", -1))))
    if w.gen >= 0 and w.acked_gen < w.gen:
        w.inbox.put({"type": "abort", "gen": w.gen})  # if idle, serve() says it left
    return True
