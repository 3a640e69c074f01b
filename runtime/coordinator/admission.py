"""Who may join (a mixin of runtime.coordinator.core.Coordinator): the control port (bound by
the supervisor, runtime/supervisor.py), the challenge on every new connection, the authentic
hello that admits a worker to a node (or takes back a dead coordinator's, succession.py), and
the connections closed for anything else (runtime/protocol.py says what the protocol allows)."""
from __future__ import annotations

import selectors
import socket
import time

from runtime.coordinator.workers import WorkerState
from runtime.protocol import MAX_LINE, Channel, authentic, hello_timeout_s, new_secret


class AdmissionMixin:
    def _adopt(self, endpoints: dict) -> None:
        """Take the control port and the store a supervisor holds (runtime/supervisor.py):
        they outlive this coordinator, so a successor is found where it was."""
        self.hello_timeout_s = hello_timeout_s()
        self.listener = socket.socket(fileno=int(endpoints["listener_fd"]))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.store_port = int(endpoints["store_port"])

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            chan = Channel(sock, max_line=MAX_LINE)
            nonce = new_secret()
            self.strangers[chan] = (nonce, time.monotonic() + self.hello_timeout_s)
            self.sel.register(sock, selectors.EVENT_READ, chan)
            chan.send({"type": "challenge", "nonce": nonce})

    def _close(self, chan: Channel, node: str | None = None, why: str | None = None) -> None:
        """Close a connection; a worker's (`node`) is then lost, for `why`."""
        self.strangers.pop(chan, None)
        try:
            self.sel.unregister(chan.sock)
        except (KeyError, ValueError):
            pass
        chan.close()
        if node is not None and self.workers[node].chan is chan and not self.workers[node].machine_down:
            self.workers[node].chan = None
            self._lost(self.workers[node], why or "connection closed")

    def _drop_strangers(self, now: float | None = None) -> None:
        """Connections that have not said an authentic hello within hello_timeout_s() (all of
        them when `now` is None: the run is over)."""
        for chan, (_, deadline) in list(self.strangers.items()):
            if now is None or now > deadline:
                self._close(chan)

    def _assign_node(self, msg: dict) -> str | None:
        node = msg.get("node")
        if node:
            return node if node in self.order else None
        free = [n for n in self.nodes if n not in self.workers or not self.workers[n].alive]
        hint = msg.get("rank_hint")
        if isinstance(hint, int) and 0 <= hint < len(self.nodes) and self.nodes[hint] in free:
            return self.nodes[hint]
        return free[0] if free else None

    def _on_hello(self, chan: Channel, msg: dict) -> str | None:
        nonce, _ = self.strangers.pop(chan)
        if msg.get("type") != "hello" or not authentic(self.secret, nonce, msg.get("mac")):
            chan.send({"type": "refused", "reason": "not the job's secret (KEEL_JOB_SECRET)"})
            self._close(chan)
            return None
        if "rejoin" in msg:  # a worker of a dead coordinator's (succession.py)
            node = self.on_rejoin(chan, msg)
            if node is None:
                chan.send({"type": "refused", "reason": "not a worker this coordinator takes back (lost, or its "
                                                        "node connected already)"})
                self._close(chan)
                return None
            self.sel.modify(chan.sock, selectors.EVENT_READ, (chan, node))
            chan.send({"type": "welcome", "node": node, "committed": self.committed, "gen": self.gen,
                       "silence_s": self.silence_s})
            return node
        node = self._assign_node(msg)
        if node is None:
            chan.send({"type": "refused", "reason": "no such node, or every node is taken"})
            self._close(chan)
            return None
        w = self.workers.get(node)
        if w is None or (not self.spawn_local and not w.alive):
            w = self.workers[node] = WorkerState(node=node, last_seen=time.monotonic())
        if w.chan is not None and w.chan is not chan:
            self._drop_channel(w)
        w.chan = chan
        self.sel.modify(chan.sock, selectors.EVENT_READ, (chan, node))
        w.pid = int(msg.get("pid") or 0) or w.pid
        if w.proc is None and w.pid and w.pid not in self.pid_history[node]:
            self.pid_history[node].append(w.pid)
        w.last_seen = time.monotonic()
        chan.send({"type": "welcome", "node": node, "scenario": self.config, "source": self.sc.source,
                   "store_port": self.store_port, "store_host": self.host, "config_hash": self.config_hash,
                   "out_dir": str(self.out.resolve()), "local_index": self.order[node], "silence_s": self.silence_s,
                   **self.welcome,
                   **({"emulation": {"anchor": self.t0, "scale": self.scale}} if self.emulated else {})})
        return node

