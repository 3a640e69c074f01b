"""A step some survivor committed alone before an abort (a coordinator's failover, a loss in
the middle of a step) starts the next generation, and is committed once every member of that
generation holds it: a real Coordinator's state, driven through its message handlers, with
channels that record what it sends. No worker processes."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from keel.progress import progress_bar
from keel.scenario import load
from runtime.coordinator import faults, generations, messages
from runtime.coordinator.core import Coordinator
from runtime.coordinator.state import Phase
from runtime.coordinator.workers import WorkerState
from runtime.protocol import Channel

RESNET = Path(__file__).resolve().parents[1] / "examples" / "resnet_groupnorm" / "scenario.toml"
MEMBERS = ("us/0", "us/1", "eu/0", "eu/1")  # ap/0 is the hot spare


class Recorder:
    """A worker's channel as the coordinator sees it: what it was sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()  # never registered: dropping the channel finds nothing to unregister
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coord(tmp_path):
    """A coordinator whose generation 1 (every training node, a slot each) was aborted at
    committed step 17: eu/1 had committed steps 18-20 on its own, the others stand at 19."""
    a, b = socket.socketpair()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    c = Coordinator(load(RESNET), tmp_path, link=Channel(a), endpoints={"listener_fd": listener.detach(),
                                                                         "store_port": 0},
                    no_faults=True, progress=False, spawn=False)
    c.bar = progress_bar(total=c.total, desc="test", enabled=False)
    st = c.state
    st.workers = {n: WorkerState(node=n, chan=Recorder(), joined=True, committed=19, role="member")
                  for n in c.nodes}
    st.workers["eu/1"].committed = 20
    st.workers["ap/0"].role = "standby"
    st.gen, st.members, st.committed = 1, list(MEMBERS), 17
    st.slot_map = {n: [i] for i, n in enumerate(MEMBERS)}
    for k in (18, 19, 20):
        for n in MEMBERS if k < 20 else ("eu/1",):
            st.reports.setdefault(k, {})[n] = {"type": "step", "gen": 1, "step": k, "loss": float(k)}
    st.enter(Phase.ABORTING)
    yield c
    c.shutdown()
    b.close()


def steps_logged(c) -> list[int]:
    return [e.step for e in c.log.events if e.kind == "step"]


def announced(c, node: str) -> dict:
    return [m for m in c.state.workers[node].chan.sent if m["type"] == "gen"][-1]


def test_the_steps_one_survivor_holds_are_committed_once_every_member_holds_them(coord):
    c, st = coord, coord.state
    generations.next_generation(c)
    gen = announced(c, "us/0")
    assert gen["start_step"] == 20 and gen["members"][gen["source"]] == "eu/1"
    assert sorted(gen["members"][i] for i in gen["behind"]) == ["eu/0", "us/0", "us/1"]
    assert st.committed == 17 and steps_logged(c) == []  # eu/1 alone holds them yet
    for n in MEMBERS:
        messages.on_ready(c, st.workers[n], {"type": "ready", "gen": st.gen, "pg_s": 0.0, "state_s": 0.0})
        assert st.committed == (20 if n == MEMBERS[-1] else 17)
    assert steps_logged(c) == [18, 19, 20] and [st.losses[k] for k in (18, 19, 20)] == [18.0, 19.0, 20.0]


def test_a_survivor_lost_before_it_sent_the_steps_only_it_held_costs_those_steps_not_the_run(coord):
    """The run failed here before 7 Dec ("every worker holding the state of step 20 is lost"):
    a partition cut off eu/1, the one worker ahead, right after the generation it was to send
    step 20 in was announced (tests/test_job_examples.py, resnet, resumed, after the
    coordinator's failover at step 17)."""
    c, st = coord, coord.state
    generations.next_generation(c)
    faults.lost(c, st.workers["eu/1"], "no heartbeat for 1.00 s")
    assert st.phase == Phase.ABORTING and st.failure is None
    for n in ("us/0", "us/1", "eu/0"):
        messages.on_aborted(c, st.workers[n], {"type": "aborted", "gen": st.gen, "committed": 19})
    generations.next_generation(c)
    assert st.failure is None
    gen = announced(c, "us/0")
    assert gen["start_step"] == 19 and "eu/1" not in gen["members"] and "ap/0" in gen["members"]
    for n in gen["members"]:
        messages.on_ready(c, st.workers[n], {"type": "ready", "gen": st.gen, "pg_s": 0.0, "state_s": 0.0})
    assert st.committed == 19 and steps_logged(c) == [18, 19] and 20 not in st.reports
