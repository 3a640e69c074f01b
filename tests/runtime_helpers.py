"""Small scenarios and helpers for the runtime's multi-process tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from keel.events import read_events
from keel.scenario import loads

REPO = Path(__file__).resolve().parents[1]

# three regions: a (2 nodes), b (2 nodes), c (1 node, the hot spare: the last node)
REGIONS = [("a", 2), ("b", 2), ("c", 1)]


def scenario_text(*, steps: int = 14, regions=REGIONS, hot_spares: int = 1, slots: int = 4,
                  interval: int = 5, faults: list[dict[str, Any]] = (), policy: str = "absorb",
                  detect_timeout_s: float = 1.0, quarantine: bool = True, extra: str = "") -> str:
    lines = [f'[run]\nname = "rt"\nseed = 5\nsteps = {steps}\n',
             f"[workload]\nslots = {slots}\nmicro_batch = 2\n",
             f'[checkpoint]\ninterval_steps = {interval}\nkeep = 5\nmode = "async"\n']
    for name, n in regions:
        lines.append(f'[[regions]]\nname = "{name}"\nnodes = {n}\ngpus_per_node = 1\n')
    for (a, _), (b, _) in zip(regions, regions[1:]):
        lines.append(f'[[links]]\na = "{a}"\nb = "{b}"\nrtt_ms = 0.1\n')
    for f in faults:
        body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in f.items())
        lines.append(f"[[faults.schedule]]\n{body}")
    lines.append(f'[policy]\nkind = "{policy}"\nheartbeat_s = 0.1\ndetect_timeout_s = {detect_timeout_s}\n'
                 f"hot_spares = {hot_spares}\nrestart_s = 5.0\nstraggler_factor = 1.5\nstraggler_window = 3\n"
                 f"quarantine = {'true' if quarantine else 'false'}\n")
    lines.append("[model]\nd_model = 32\nlayers = 1\nheads = 2\ncontext = 32\n")
    lines.append("[data]\nshards = 16\n")
    return "\n".join(lines) + extra


def scenario(**kw):
    return loads(scenario_text(**kw), "<test scenario>")


def run(tmp: Path, name: str, **kw) -> tuple[dict[str, Any], list]:
    """Run in this process (the fork server stays warm between tests)."""
    from runtime.api import run_scenario
    hangs = kw.pop("hangs", None)
    out = tmp / name
    summary = run_scenario(scenario(**kw), out, progress=False, hangs=hangs or "")
    return summary, read_events(out / "events.jsonl")


def kinds(events, fault_id=None) -> list[str]:
    return [e.kind for e in events if fault_id is None or e.detail.get("fault_id") == fault_id]


def write_scenario(tmp: Path, name: str = "scenario.toml", **kw) -> Path:
    p = tmp / name
    p.write_text(scenario_text(**kw))
    return p


def keel(*args: str) -> list[str]:
    return [sys.executable, "-m", "keel.cli", *args]


def run_and_kill_when(args: list[str], out: Path, done, what: str, timeout: float = 120.0) -> list[dict]:
    """Start `keel run` in a session of its own, wait until `done(events)` holds for the events
    logged so far (dicts, as in events.jsonl), then SIGKILL every process of the job; those
    events. For runs whose length in steps cannot say when what a test waits for is over."""
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=str(REPO))
    ev = out / "events.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ev.exists():
                events = []
                for line in ev.read_text().splitlines():
                    try:
                        events.append(json.loads(line))
                    except ValueError:  # the line being written
                        break
                if done(events):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return events
            if proc.poll() is not None:
                raise AssertionError(f"keel run ended (rc {proc.returncode}) before {what}")
            time.sleep(0.005)
        raise AssertionError(f"no {what} within {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_and_kill_after_checkpoint(args: list[str], out: Path, ckpt_step: int, timeout: float = 120.0) -> int:
    """`run_and_kill_when` the checkpoint of `ckpt_step` is complete (its checkpoint_end
    event); the step it was logged at."""
    def written_at(events: list[dict]) -> int | None:
        return next((d["step"] for d in events if d.get("kind") == "checkpoint_end"
                     and d["detail"].get("ckpt_step") == ckpt_step and d["detail"].get("path")), None)
    return written_at(run_and_kill_when(args, out, lambda events: written_at(events) is not None,
                                        f"checkpoint {ckpt_step}", timeout))


def bare_coordinator(scenario, out: Path, **kw):
    """A Coordinator in this process, for tests that drive its methods: a link nobody serves
    and a control port of its own, as a supervisor would hand them over (runtime/supervisor.py)."""
    import socket
    from runtime.coordinator import Coordinator
    from runtime.protocol import Channel
    os.environ.setdefault("KEEL_JOB_SECRET", "test")
    ours, theirs = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    coord = Coordinator(scenario, out, link=Channel(theirs), endpoints={"listener_fd": listener.detach(), "store_port": 0},
                        progress=False, **kw)
    coord._test_link_peer = ours  # keep the other end open
    return coord
