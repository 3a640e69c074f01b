"""The coordinator's link to its supervisor (runtime/supervisor.py), which outlives it: the
supervisor starts workers when asked (`spawn`), tells of their exits (`exited`), and takes a
coordinator that says no `hb` for a while for hung. The link owns what it heard; the
coordinator reads `exits` and `gone`."""
from __future__ import annotations

import select
import threading
import time
from typing import Any, Callable, TypeVar

from runtime.protocol import Channel

HB_S = 0.5
T = TypeVar("T")


class SupervisorLink:
    def __init__(self, chan: Channel | None):
        self.chan = chan
        self.exits: dict[int, int | None] = {}   # worker pid -> exit code, as the supervisor says
        self.spawned: dict[str, int] = {}        # node -> pid of the worker it started last
        self.gone = False                        # the supervisor closed the link: the run cannot go on
        self.hb_t = 0.0

    def serve(self) -> None:
        """Read what the supervisor said (the link is readable)."""
        msgs = self.chan.recv_ready()
        if msgs is None:
            self.gone = True
            return
        for msg in msgs:
            if msg.get("type") == "exited":
                self.exits[int(msg["pid"])] = msg.get("rc")
            elif msg.get("type") == "spawned":
                self.spawned[str(msg["node"])] = int(msg["pid"])

    def beat(self) -> None:
        now = time.monotonic()
        if self.chan is not None and now - self.hb_t > HB_S:
            self.hb_t = now
            self.chan.send({"type": "hb"})

    def wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """Serve the link until `done()` or `timeout` seconds; done()."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.chan is None:
                return done()
            self.beat()
            ready, _, _ = select.select([self.chan.sock], [], [], min(left, 0.05))
            if ready:
                self.serve()
                if self.gone:
                    return done()
        return True

    def in_background(self, fn: Callable[[], T]) -> T:
        """fn() in a thread of its own while this one keeps serving the link (and saying hb):
        a long synchronous operation, such as verifying a large checkpoint, is not taken for a
        hang. Without a supervisor, fn() here. Its exception is raised here."""
        if self.chan is None:
            return fn()
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # raised again in the caller's thread
                out["error"] = e
        t = threading.Thread(target=call, name="keel-coordinator-io", daemon=True)
        t.start()
        self.wait(lambda: not t.is_alive(), float("inf"))
        t.join()  # the link may have failed first: the operation still ends before we go on
        if "error" in out:
            raise out["error"]
        return out["value"]

    def spawn(self, node: str, fresh: bool) -> int:
        """Have the supervisor start the worker of `node`; its pid."""
        self.spawned.pop(node, None)
        self.chan.send({"type": "spawn", "node": node, "fresh": fresh})
        if not self.wait(lambda: node in self.spawned, 120.0):
            raise RuntimeError(f"the supervisor did not start the worker of {node}")
        return self.spawned.pop(node)

    def send(self, msg: dict[str, Any]) -> None:
        """A last word to the supervisor (blocking: the coordinator is about to die or end)."""
        self.chan.sock.setblocking(True)
        self.chan.send(msg)
