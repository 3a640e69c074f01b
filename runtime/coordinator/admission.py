"""Who may join: the connections to the control port (bound by the supervisor,
runtime/supervisor.py), the challenge on every new one, the authentic hello that admits a
worker to a node (or takes back a dead coordinator's, succession.py), and the connections
closed for anything else (runtime/protocol.py says what the protocol allows). Functions of
the Coordinator (core.py): the connections are its own, the workers its state's (state.py)."""
from __future__ import annotations

import selectors
import time
from typing import TYPE_CHECKING

from runtime.coordinator import faults, succession
from runtime.coordinator.workers import WorkerState
from runtime.protocol import MAX_LINE, Channel, authentic, new_secret

if TYPE_CHECKING:
    from runtime.coordinator.core import Coordinator


def accept(c: Coordinator) -> None:
    while True:
        try:
            sock, _ = c.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        chan = Channel(sock, max_line=MAX_LINE)
        nonce = new_secret()
        c.strangers[chan] = (nonce, time.monotonic() + c.hello_timeout_s)
        c.sel.register(sock, selectors.EVENT_READ, chan)
        chan.send({"type": "challenge", "nonce": nonce})


def close(c: Coordinator, chan: Channel, node: str | None = None, why: str | None = None) -> None:
    """Close a connection; a worker's (`node`) is then lost, for `why`."""
    c.strangers.pop(chan, None)
    try:
        c.sel.unregister(chan.sock)
    except (KeyError, ValueError):
        pass
    chan.close()
    workers = c.state.workers
    if node is not None and workers[node].chan is chan and not workers[node].machine_down:
        workers[node].chan = None
        faults.lost(c, workers[node], why or "connection closed")


def drop_strangers(c: Coordinator, now: float | None = None) -> None:
    """Connections that have not said an authentic hello within hello_timeout_s() (all of
    them when `now` is None: the run is over)."""
    for chan, (_, deadline) in list(c.strangers.items()):
        if now is None or now > deadline:
            close(c, chan)


def _assign_node(c: Coordinator, msg: dict) -> str | None:
    node = msg.get("node")
    if node:
        return node if node in c.order else None
    workers = c.state.workers
    free = [n for n in c.nodes if n not in workers or not workers[n].alive]
    hint = msg.get("rank_hint")
    if isinstance(hint, int) and 0 <= hint < len(c.nodes) and c.nodes[hint] in free:
        return c.nodes[hint]
    return free[0] if free else None


def on_hello(c: Coordinator, chan: Channel, msg: dict) -> str | None:
    st = c.state
    nonce, _ = c.strangers.pop(chan)
    if msg.get("type") != "hello" or not authentic(c.secret, nonce, msg.get("mac")):
        chan.send({"type": "refused", "reason": "not the job's secret (KEEL_JOB_SECRET)"})
        close(c, chan)
        return None
    if "rejoin" in msg:  # a worker of a dead coordinator's (succession.py)
        node = succession.on_rejoin(c, chan, msg)
        if node is None:
            chan.send({"type": "refused", "reason": "not a worker this coordinator takes back (lost, or its "
                                                    "node connected already)"})
            close(c, chan)
            return None
        c.sel.modify(chan.sock, selectors.EVENT_READ, (chan, node))
        chan.send({"type": "welcome", "node": node, "committed": st.committed, "gen": st.gen,
                   "silence_s": c.silence_s})
        return node
    node = _assign_node(c, msg)
    if node is None:
        chan.send({"type": "refused", "reason": "no such node, or every node is taken"})
        close(c, chan)
        return None
    w = st.workers.get(node)
    if w is None or (not c.spawn_local and not w.alive):
        w = st.workers[node] = WorkerState(node=node, last_seen=time.monotonic())
    if w.chan is not None and w.chan is not chan:
        c.drop_channel(w)
    w.chan = chan
    c.sel.modify(chan.sock, selectors.EVENT_READ, (chan, node))
    w.pid = int(msg.get("pid") or 0) or w.pid
    if w.proc is None and w.pid and w.pid not in st.pid_history[node]:
        st.pid_history[node].append(w.pid)
    w.last_seen = time.monotonic()
    chan.send({"type": "welcome", "node": node, "scenario": c.config, "source": c.sc.source,
               "store_port": c.store_port, "store_host": c.host, "config_hash": c.config_hash,
               "out_dir": str(c.out.resolve()), "local_index": c.order[node], "silence_s": c.silence_s,
               **c.welcome,
               **({"emulation": {"anchor": st.t0, "scale": c.scale}} if c.emulated else {})})
    return node
