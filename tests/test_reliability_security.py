"""Only the job's workers join (issue 13): a stranger's connection, whatever it sends, cannot
join, heartbeat, report or change membership, nor crash or stall the coordinator; the job
listens on loopback only; its secret is never written down.

The attack runs against a real 5-worker run: its final weights and losses must equal those
of the same run left alone, with no worker lost and no restart.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from runtime.protocol import (MAX_LINE, Channel, ProtocolError, authentic, check_worker_message, hello_mac)
from runtime_helpers import run, scenario

pytestmark = [pytest.mark.timeout(240), pytest.mark.reliability]


def _connect(port: int) -> tuple[socket.socket, dict]:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    chan = Channel(s)
    return s, chan.recv()


def _refused_or_closed(s: socket.socket) -> str:
    """What the coordinator answered before it closed the connection ('' for nothing)."""
    s.settimeout(30)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return data.decode(errors="replace")


def _attacks(port: int, node: str) -> list[tuple[str, str]]:
    """Every hostile input tried: (name, what the coordinator answered before closing)."""
    out = []

    def attack(name: str, payload: bytes | None, hello: dict | None = None) -> None:
        s, challenge = _connect(port)
        assert challenge["type"] == "challenge"
        if hello is not None:
            hello = {k: (v(challenge["nonce"]) if callable(v) else v) for k, v in hello.items()}
            payload = (json.dumps(hello) + "\n").encode()
        try:
            s.sendall(payload)
        except OSError:
            pass
        out.append((name, _refused_or_closed(s)))

    attack("hello without a mac", None, {"type": "hello", "node": node})
    attack("hello with a wrong mac", None, {"type": "hello", "node": node, "mac": "0" * 64})
    attack("hello with the mac of another nonce", None,
           {"type": "hello", "node": node, "mac": lambda nonce: hello_mac("not-the-secret", nonce)})
    attack("a step report before any hello", b'{"type":"step","gen":0,"step":99,"loss":0.0}\n')
    attack("a heartbeat before any hello", b'{"type":"hb"}\n')
    attack("garbage", os.urandom(4096).replace(b"\n", b" ") + b"\n")
    attack("a JSON array", b"[1,2,3]\n")
    attack("deeply nested JSON", b"[" * 100_000 + b"]" * 100_000 + b"\n")
    attack("a line longer than MAX_LINE", b"x" * (MAX_LINE + 10))
    attack("a 2^62 length prefix", (1 << 62).to_bytes(8, "big") + b"\n")
    return out


def test_strangers_cannot_join_or_disturb_a_run(tmp_path, monkeypatch, record):
    from runtime.api import run_scenario
    import runtime.supervisor as supervisor
    monkeypatch.setenv("KEEL_HELLO_TIMEOUT_S", "1.0")  # the coordinator (a child process) reads it
    kw = dict(steps=60, hot_spares=1)
    alone, _ = run(tmp_path, "alone", **kw)

    sups: list = []
    real_init = supervisor.Supervisor.__init__

    def spy(self, *a, **k):  # the test needs the job's port and secret
        real_init(self, *a, **k)
        sups.append(self)
    supervisor.Supervisor.__init__ = spy
    try:
        result: dict = {}
        out = tmp_path / "attacked"
        t = threading.Thread(target=lambda: result.update(s=run_scenario(scenario(**kw), out, progress=False,
                                                                         hangs="")), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not sups and time.monotonic() < deadline:
            time.sleep(0.01)
        coord = sups[0]
        # a silent connection, open through all the attacks: dropped, never admitted
        silent = socket.create_connection(("127.0.0.1", coord.port), timeout=10)
        answers = _attacks(coord.port, "a/0")
        silent.settimeout(30)  # dropped after HELLO_TIMEOUT_S, while the run goes on
        assert silent.recv(4096).startswith(b'{"type":"challenge"')
        assert silent.recv(4096) == b""
        silent_dropped_mid_run = t.is_alive()
        t.join(180)
    finally:
        supervisor.Supervisor.__init__ = real_init
    assert not t.is_alive(), "the attacked run did not finish"
    attacked = result["s"]

    for name, answer in answers:
        assert "welcome" not in answer, f"{name}: admitted"
    assert all("refused" in a for n, a in answers if n.startswith("hello")), answers
    assert attacked["restarts"] == 0 and not attacked["faults"], attacked
    assert attacked["losses"] == alone["losses"]
    assert attacked["final_weights_sha256"] == alone["final_weights_sha256"]
    assert all(len(p) == 1 for p in attacked["pids"].values()), "a worker was replaced"

    assert silent_dropped_mid_run, "the run ended before the silent connection's timeout: lengthen it"

    # the secret is in no file the run wrote
    secret = coord.secret.encode()
    for f in out.rglob("*"):
        if f.is_file():
            assert secret not in f.read_bytes(), f"the job's secret is written in {f}"
    record(trials=1, bad_inputs=len(answers) + 1)  # + the silent connection


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids` (Linux /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, port = f[1].split(":")
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append((_address(addr, width), int(port, 16)))
    return out


def _address(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_a_running_job_listens_on_loopback_only(tmp_path, record):
    """keel run (the supervisor: control port, rendezvous store), its coordinator and every
    worker's gloo listener, looked at mid-run with every group formed."""
    import threading
    import time
    from runtime.api import run_scenario
    seen: list[tuple[str, int]] = []
    out = tmp_path / "run"
    t = threading.Thread(target=run_scenario, args=(scenario(steps=60), out), kwargs={"progress": False, "hangs": ""},
                         daemon=True)
    t.start()
    ev = out / "events.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (ev.exists() and ev.read_text().count('"kind":"step"') >= 5):
        time.sleep(0.05)
    from test_reliability_soak import descendants
    seen.extend(_listening({os.getpid(), *descendants(os.getpid())}))
    t.join(120)
    assert seen, "no listening socket found"
    exposed = [(a, p) for a, p in seen if a not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed, f"listening beyond loopback: {exposed}"
    record(trials=1)
    record.note("listening sockets", len(seen))


def test_listening_beyond_loopback_warns_and_names_what_is_exposed(tmp_path, capsys, monkeypatch):
    from runtime.supervisor import Supervisor
    monkeypatch.setenv("KEEL_JOB_SECRET", "x")
    sup = Supervisor(scenario(steps=2), tmp_path / "run", spawn=False, listen="0.0.0.0:0")
    try:
        err = capsys.readouterr().err
        assert "listening beyond this machine on 0.0.0.0" in err
        assert f"coordinator's port {sup.port}" in err and "rendezvous store" in err
    finally:
        sup.listener.close()


def test_a_coordinator_without_its_workers_needs_a_secret(tmp_path, monkeypatch):
    from keel.errors import InputError
    from runtime.supervisor import Supervisor
    monkeypatch.delenv("KEEL_JOB_SECRET", raising=False)
    with pytest.raises(InputError, match="KEEL_JOB_SECRET: not set"):
        Supervisor(scenario(steps=2), tmp_path / "run", spawn=False)
    assert not (tmp_path / "run").exists()


def test_protocol_rejects_what_it_does_not_declare(record):
    assert authentic("s", "n", hello_mac("s", "n"))
    assert not authentic("s", "n", hello_mac("t", "n"))
    assert not authentic("s", "n", None) and not authentic("s", "n", 42)
    check_worker_message({"type": "step", "gen": 0, "step": 1, "loss": 2.5, "late_s": 0.0})
    check_worker_message({"type": "hb", "at": "x", "probe_s": 0.1})
    bad = [{"type": "step", "gen": "0", "step": 1, "loss": 2.5},
           {"type": "step", "gen": 0, "step": 1},
           {"type": "step", "gen": True, "step": 1, "loss": 1.0},
           {"type": "nonfinite", "gen": 0, "step": 1, "suspects": "all"},
           {"type": "done", "gen": 0, "committed": 3, "sha256": None},
           {"type": "hb", "probe_s": "slow"},
           {"type": "become-coordinator"}]
    for msg in bad:
        with pytest.raises(ProtocolError):
            check_worker_message(msg)
    record(trials=1, bad_inputs=len(bad) + 3 + 1)  # the messages, three false macs, an overlong line
    server = socket.create_server(("127.0.0.1", 0))
    b = socket.create_connection(server.getsockname())
    a, _ = server.accept()
    server.close()
    try:
        chan = Channel(a, max_line=16)
        b.sendall(b'{"type":"hb"}\n' + b"y" * 40)
        with pytest.raises(ProtocolError, match="over 16 bytes"):
            chan.recv_ready()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("::ffff:10.0.0.5", False), ("example.org", False),
    ("", False)])
def test_one_rule_says_what_stays_on_this_machine(host, loopback):
    """keel.net.is_loopback decides both the job's bind warning and the dashboard's."""
    from keel.net import is_loopback
    assert is_loopback(host) is loopback
