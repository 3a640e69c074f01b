"""The control channel between the coordinator and a worker: one TCP connection per worker
carrying JSON lines, one message a line, each an object with a "type".

Worker -> coordinator: hello, hb (heartbeat: where the worker is, `at`, for stall reports;
with a probe of its communication path while it stands by), ready (joined a generation), step (committed a step: loss and timings), nonfinite,
aborted (left a generation, with its committed step), ckpt_start, ckpt_end, done, error.
Coordinator -> worker: welcome (node name, resolved scenario, store address), gen (a
generation: rank, members, slot map, start step, state source), standby, abort, quarantine,
jitter (injected network delay), kill (for workers the coordinator cannot signal), stop.

A worker's death shows at once as EOF on its connection; a hung worker by missing heartbeats.
"""
from __future__ import annotations

import json
import socket
import threading
from typing import Any


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = default_host, text
    if not port.isdigit() or not 0 <= int(port) < 65536:
        from keel.errors import InputError
        raise InputError(f"--coordinator {text!r}: expected HOST:PORT with a port number")
    return host or default_host, int(port)


class Channel:
    """JSON lines over a socket. `send` is thread-safe; `recv_ready` parses whatever arrived
    (for a select loop); `recv` blocks for the next message (for a reader thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._lock = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict[str, Any]) -> bool:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False

    def _fill(self) -> bool | None:
        """One recv() into the buffer: True if bytes came, None if none were waiting (a
        non-blocking socket), False at EOF or on a broken connection."""
        try:
            chunk = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            return False
        self._buf += chunk
        return True

    def recv_ready(self) -> list[dict[str, Any]] | None:
        """Messages from one recv(); None at EOF or on a broken connection."""
        got = self._fill()
        if got is False:
            return None
        if got is None:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def recv(self) -> dict[str, Any] | None:
        """The next message, blocking; None at EOF."""
        while b"\n" not in self._buf:
            if self._fill() is False:
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line) if line.strip() else self.recv()

    def close(self) -> None:
        with self._lock:
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
