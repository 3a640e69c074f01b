"""Who may join (a mixin of runtime.coordinator.core.Coordinator): the control port and the
rendezvous store bound to the coordinator's host, the challenge on every new connection, the
authentic hello that admits a worker to a node, and the connections closed for anything else
(runtime/protocol.py says what the protocol allows)."""
from __future__ import annotations

import datetime
import selectors
import socket
import sys
import time

from keel.errors import InputError
from runtime.coordinator.workers import WorkerState
from runtime.protocol import HELLO_TIMEOUT_S, MAX_LINE, Channel, authentic, new_secret


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdmissionMixin:
    def _listen(self) -> None:
        """The control port and the rendezvous store, both bound to `self.host` only (torch's
        TCPStore alone would listen on every interface: it is handed a socket bound here).
        Beyond loopback, a warning names what is exposed."""
        import torch.distributed as dist
        host, port = self.host, self.port_wanted
        try:
            self.listener = socket.create_server((host, port), backlog=256)
            store_sock = socket.create_server((host, 0), backlog=256)
        except OSError as e:
            raise InputError(f"--listen {host}:{port}: cannot listen there ({e.strerror or e})") from None
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        store_port = store_sock.getsockname()[1]
        self.store = dist.TCPStore(host, store_port, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=300), master_listen_fd=store_sock.detach())
        if not _loopback(host):
            print(f"keel: warning: listening beyond this machine on {host}: the coordinator's port {self.port} "
                  f"(workers must prove the job's secret) and the rendezvous store's port {store_port} "
                  f"(torch's TCPStore: no authentication); firewall them to the job's machines",
                  file=sys.stderr, flush=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            chan = Channel(sock, max_line=MAX_LINE)
            nonce = new_secret()
            self.strangers[chan] = (nonce, time.monotonic() + HELLO_TIMEOUT_S)
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
        """Connections that have not said an authentic hello within HELLO_TIMEOUT_S (all of
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
                   "store_port": self.store.port, "store_host": self.host, "config_hash": self.config_hash,
                   "out_dir": str(self.out.resolve()), "local_index": self.order[node], "silence_s": self.silence_s,
                   **self.welcome,
                   **({"emulation": {"anchor": self.t0, "scale": self.scale}} if self.emulated else {})})
        return node

