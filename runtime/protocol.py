"""The control channel between the coordinator and a worker: one TCP connection per worker
carrying JSON lines, one message a line, each an object with a "type".

Worker -> coordinator: hello, hb (heartbeat: where the worker is, `at`, for stall reports;
with a probe of its communication path while it stands by), ready (joined a generation), step (committed a step: loss and timings), nonfinite,
aborted (left a generation, with its committed step), ckpt_start, ckpt_end, done, error.
Coordinator -> worker: challenge, welcome (node name, resolved scenario, store address, the
silence after which a worker gives its coordinator up), hb (at least every second), gen (a
generation: rank, members, slot map, start step, state source), standby, abort, quarantine,
jitter (injected network delay), kill and partition (injected, for workers the coordinator
cannot signal: die; freeze until `heal_s` has passed), stop.

A worker's death shows at once as EOF on its connection; a hung worker by missing heartbeats.
A coordinator's death shows a worker EOF, and a hung or unreachable one silence: a worker exits
(code 3) when its connection closes or its coordinator has said nothing for the welcome's
`silence_s` (COORDINATOR_SILENCE_S), so no worker outlives its job.

Only the job's workers join. On every connection the coordinator first sends a challenge (a
fresh random nonce); the worker's hello carries HMAC-SHA256(job secret, nonce). A connection
whose first message is not an authentic hello, that says nothing for HELLO_TIMEOUT_S, that
sends a line longer than MAX_LINE or one that is not a JSON object, is closed; nothing it sent
counts. The secret is generated per job by `keel run` and handed to the workers it starts
through their environment (KEEL_JOB_SECRET), never on a command line, in a log or in the run
directory; workers started elsewhere (torchrun) take it from KEEL_JOB_SECRET.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from typing import Any

SECRET_ENV = "KEEL_JOB_SECRET"
MAX_LINE = 1 << 20       # bytes: the longest message a coordinator reads from a connection
HELLO_TIMEOUT_S = 10.0   # wall seconds a new connection has to say an authentic hello
HELLO_TIMEOUT_ENV = "KEEL_HELLO_TIMEOUT_S"  # overrides it (tests, operators)
COORDINATOR_SILENCE_S = 30.0  # wall seconds a worker waits on a silent coordinator, then exits
SILENCE_ENV = "KEEL_COORDINATOR_SILENCE_S"  # overrides it (tests, operators)
EXIT_COORDINATOR_LOST = 3  # a worker's exit code when its coordinator is gone (silent, closed, or refused it)
# A step is committed when the coordinator's log holds it; the coordinator confirms what it
# committed in its hb (`committed`). A worker applies step k to its weights only once step
# k - COMMIT_LEAD_STEPS is confirmed (training does not wait on the coordinator's round trip),
# and publishes a checkpoint of step k only once step k itself is confirmed (the checkpoint's
# last rename waits for it). A worker cut off from its coordinator thus applies at most
# COMMIT_LEAD_STEPS steps ahead, in memory, and nothing it did alone becomes durable: those steps
# are lost with the process, never committed, and never in a checkpoint a resume could take.
# A minority commits nothing either: generations come from the coordinator alone.
COMMIT_LEAD_STEPS = 16
CONFIRM_EVERY_STEPS = 8


def confirm_due(committed: int, confirmed: int, checkpoint_interval: int) -> bool:
    """Whether the coordinator confirms its committed step now, not only at its next heartbeat:
    every CONFIRM_EVERY_STEPS commits (the workers' lead), and at once when the step is one a
    checkpoint is written at (its writer waits for that word to publish it)."""
    return (committed - confirmed >= CONFIRM_EVERY_STEPS
            or (committed > confirmed and committed % checkpoint_interval == 0))


def heartbeat_period(silence: float) -> float:
    """How often a coordinator speaks to every worker: at least ten times within `silence`, and
    at least every second."""
    return min(1.0, silence / 10)


class ProtocolError(Exception):
    """A peer sent something the protocol does not allow: the connection is closed."""


_NUM = (int, float)
# what each worker -> coordinator message must carry (key: type), checked before it is handled
WORKER_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {}, "hb": {}, "joined": {}, "bye": {}, "error": {},
    "step": {"gen": int, "step": int, "loss": _NUM},
    "ready": {"gen": int, "pg_s": _NUM, "state_s": _NUM},
    "nonfinite": {"gen": int, "step": int, "suspects": list},
    "aborted": {"gen": int, "committed": int},
    "ckpt_start": {"step": int},
    "ckpt_end": {"step": int},
    "done": {"gen": int, "committed": int, "sha256": str},
}
_OPTIONAL = {"probe_s": _NUM, "late_s": _NUM, "committed": int, "message": str, "params": int}


def check_worker_message(msg: dict[str, Any]) -> None:
    """ProtocolError unless `msg` is a message a worker may send, with its fields' types."""
    kind = msg["type"]
    fields = WORKER_FIELDS.get(kind)
    if fields is None:
        raise ProtocolError(f"a message of unknown type {kind[:40]!r}")
    for key, types in list(fields.items()) + [(k, t) for k, t in _OPTIONAL.items() if k in msg]:
        value = msg.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(f"a {kind!r} message whose {key!r} is {type(value).__name__}")


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def silence_s() -> float:
    """COORDINATOR_SILENCE_S, or the positive number of seconds in KEEL_COORDINATOR_SILENCE_S."""
    return _env_seconds(SILENCE_ENV, COORDINATOR_SILENCE_S)


def hello_timeout_s() -> float:
    """HELLO_TIMEOUT_S, or the positive number of seconds in KEEL_HELLO_TIMEOUT_S."""
    return _env_seconds(HELLO_TIMEOUT_ENV, HELLO_TIMEOUT_S)


def new_secret() -> str:
    return secrets.token_hex(32)


def env_secret() -> str | None:
    """The job's secret from KEEL_JOB_SECRET, or None where it is unset or empty."""
    return os.environ.get(SECRET_ENV) or None


def hello_mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), b"keel-hello:" + nonce.encode(), hashlib.sha256).hexdigest()


def authentic(secret: str, nonce: str, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(hello_mac(secret, nonce), mac)


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

    def __init__(self, sock: socket.socket, max_line: int | None = None):
        self.sock = sock
        self.max_line = max_line  # None: no limit (a worker reading its coordinator's welcome)
        if sock.family != socket.AF_UNIX:  # a supervisor's link is a Unix socketpair
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
        """Messages from one recv(); None at EOF or on a broken connection. Raises
        ProtocolError for a line over `max_line` bytes or one that is not a JSON object."""
        got = self._fill()
        if got is False:
            return None
        if got is None:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        if self.max_line is not None and (len(self._buf) > self.max_line or any(len(x) > self.max_line for x in lines)):
            raise ProtocolError(f"a message over {self.max_line} bytes")
        return [_parse(line) for line in lines if line.strip()]

    def recv(self) -> dict[str, Any] | None:
        """The next message, blocking; None at EOF."""
        while b"\n" not in self._buf:
            if self._fill() is False:
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return _parse(line) if line.strip() else self.recv()

    def close(self) -> None:
        with self._lock:
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _parse(line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("a message that is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("a message that is not a JSON object with a type")
    return msg
