"""A generation formed after the last step finishes the run instead of stalling. (What a
stall report says is tested as a plain function in tests/test_coordinator_decisions.py.)"""
from __future__ import annotations

import time

import pytest

from runtime_helpers import bare_coordinator, scenario

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_a_generation_formed_after_the_last_step_finishes_the_run(tmp_path):
    """Seen in validate: a straggler's slots moved back just as the last step was committed;
    the generation formed at start step == run.steps had nothing to run, its members reported
    done, and the coordinator waited for a step that never comes (60 s stall)."""
    from runtime.coordinator import Phase, WorkerState, generations
    coord = bare_coordinator(scenario(steps=14), tmp_path / "out", spawn=False)
    st = coord.state
    try:
        now = time.monotonic()
        st.t0 = now
        coord.bar = None
        st.gen, st.committed = 2, 14
        st.slot_map = {"a/0": [0, 1], "b/0": [2], "b/1": [3]}
        for n in coord.nodes:
            w = st.workers[n] = WorkerState(node=n, joined=True, last_seen=now, last_hb_t=now)
            w.chan = _Recorder()
            w.committed = 14
        generations.announce(coord, load=None, start=14)
        assert st.phase == Phase.FINISHING
        for n in ("a/0", "b/0", "b/1"):
            coord.on_message(st.workers[n], {"type": "done", "sha256": "f" * 64, "committed": 14, "gen": 3})
        assert st.phase == Phase.FINISHED and st.final_sha == "f" * 64 and st.failure is None
    finally:
        for w in st.workers.values():
            w.chan = None  # recorders, not sockets
        coord.shutdown()
