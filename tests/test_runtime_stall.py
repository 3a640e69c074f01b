"""A stall explains itself: the coordinator's "no progress" failure says, per worker, its role,
committed step, whether it got through the generation's set-up, its last message and where
its heartbeat says it is (issue 4: an intermittent stall after a hot spare took over)."""
from __future__ import annotations

import time

import pytest

from runtime_helpers import scenario

pytestmark = pytest.mark.timeout(60)


def test_stall_report_names_what_each_member_last_said(tmp_path):
    from runtime.coordinator import Coordinator, WorkerState
    coord = Coordinator(scenario(steps=14), tmp_path / "out", progress=False, spawn=False)
    try:
        now = time.monotonic()
        coord.t0 = now
        coord.bar = None
        nodes = coord.nodes  # a/0 a/1 b/0 b/1 c/0 (the spare)
        coord.gen, coord.committed, coord.gen_start_step = 1, 4, 4
        coord.members = ["a/0", "b/0", "b/1", "c/0"]
        coord.slot_map = {"a/0": [0], "b/0": [2], "b/1": [3], "c/0": [1]}
        for n in nodes:
            w = coord.workers[n] = WorkerState(node=n, joined=True, last_seen=now, last_hb_t=now - 0.05)
            w.role = "member" if n in coord.members else "dead"
            w.alive = n != "a/1"
            w.committed = 0 if n == "c/0" else 4
            w.ready_gen = 0 if n in ("a/0", "c/0") else 1
            w.last_msg, w.last_msg_t = {"type": "ready", "gen": w.ready_gen}, now - 59.0
            w.at = f"gen 1: state broadcast, {'sending' if n == 'a/0' else 'receiving'}, party [0, 3]: 1000 values" \
                if n in ("a/0", "c/0") else "gen 1 step 5: in the reduction"
        coord.reports = {5: {"b/0": {"loss": 1.0}, "b/1": {"loss": 1.0}}}
        coord.phase = "running"
        coord.last_progress = now - 61.0
        coord._tick()
        msg = coord.failure
        assert msg is not None and msg.startswith("no progress for 60 s (phase running, generation 1, committed 4")
        lines = {line.split(":", 1)[0].strip(): line for line in msg.splitlines()[1:]}
        assert "NOT ready" in lines["c/0"] and "receiving, party [0, 3]" in lines["c/0"]
        assert "committed 0" in lines["c/0"] and "no report of step 5" in lines["c/0"]
        assert "sending" in lines["a/0"] and "NOT ready" in lines["a/0"]
        assert "reported step 5" in lines["b/0"] and "ready," in lines["b/0"]
        assert "last message 'ready gen=1' 59." in lines["b/1"]
        assert "dead" in lines["a/1"]
        assert (tmp_path / "out" / "stall.txt").read_text().strip() == msg
    finally:
        coord._shutdown()


class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_a_generation_formed_after_the_last_step_finishes_the_run(tmp_path):
    """Seen in validate: a straggler's slots moved back just as the last step was committed;
    the generation formed at start step == run.steps had nothing to run, its members reported
    done, and the coordinator waited for a step that never comes (60 s stall)."""
    from runtime.coordinator import Coordinator, WorkerState
    coord = Coordinator(scenario(steps=14), tmp_path / "out", progress=False, spawn=False)
    try:
        now = time.monotonic()
        coord.t0 = now
        coord.bar = None
        coord.gen, coord.committed = 2, 14
        coord.slot_map = {"a/0": [0, 1], "b/0": [2], "b/1": [3]}
        for n in coord.nodes:
            w = coord.workers[n] = WorkerState(node=n, joined=True, last_seen=now, last_hb_t=now)
            w.chan = _Recorder()
            w.committed = 14
        coord._announce(load=None, start=14)
        assert coord.phase == "finishing"
        for n in ("a/0", "b/0", "b/1"):
            coord._on_message(coord.workers[n], {"type": "done", "sha256": "f" * 64, "committed": 14, "gen": 3})
        assert coord.phase == "finished" and coord.final_sha == "f" * 64 and coord.failure is None
    finally:
        for w in coord.workers.values():
            w.chan = None  # recorders, not sockets
        coord._shutdown()
