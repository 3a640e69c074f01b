"""The coordinator's decisions as plain functions: slot planning over a View, the episode
book's stages, the straggler watch, the stall report. No processes, no sockets."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.coordinator.episodes import EpisodeBook, Stage
from runtime.coordinator.planning import Loss, View, WorkerView, initial_slot_map, plan_generation
from runtime.coordinator.stall import stall_report
from runtime.coordinator.stragglers import StragglerWatch

NODES = ("a/0", "a/1", "b/0", "b/1", "c/0")  # c/0 is the hot spare
SPEEDS = {"a": 1.0, "b": 1.0, "c": 1.0}
LAYOUT = {"a/0": (0,), "a/1": (1,), "b/0": (2,), "b/1": (3,)}


def view(slot_map=LAYOUT, dead=(), committed=10, speeds=SPEEDS, nodes=NODES, **kw) -> View:
    workers = {n: WorkerView(alive=n not in dead, committed=committed) for n in nodes}
    workers.update(kw.pop("workers", {}))
    return View(nodes=nodes, region_speed=speeds, slot_map=slot_map, workers=workers, committed=committed, **kw)


def test_initial_slot_map_is_round_robin_and_a_spare_fills_in_for_a_dead_training_node():
    assert initial_slot_map(view(slot_map={}), training=4, slots=6) == {
        "a/0": [0, 4], "a/1": [1, 5], "b/0": [2], "b/1": [3]}
    assert initial_slot_map(view(slot_map={}, dead=("a/1",)), training=4, slots=4) == {
        "a/0": [0], "b/0": [1], "b/1": [2], "c/0": [3]}


def test_a_killed_worker_moves_to_the_hot_spare():
    plan = plan_generation(view(dead=("a/1",), losses={"a/1": Loss(0, "replicate_resume", "a/1")}))
    assert plan.failure is None and plan.start == 10
    assert plan.slot_map == {"a/0": [0], "b/0": [2], "b/1": [3], "c/0": [1]}
    assert plan.moves == {0: [(1, "a/1", "c/0")]}


def test_without_a_spare_a_killed_worker_goes_to_the_fastest_finish():
    dead = ("a/1", "c/0")
    layout = {"a/0": (0, 4), "a/1": (1,), "b/0": (2,), "b/1": (3,)}
    plan = plan_generation(view(slot_map=layout, dead=dead, losses={"a/1": Loss(3, "replicate_resume", "a/1")}))
    assert plan.slot_map == {"a/0": [0, 4], "b/0": [1, 2], "b/1": [3]}


def test_a_rack_loss_spreads_over_the_other_regions_by_speed():
    speeds = {"a": 3.0, "b": 1.0, "c": 1.0}
    layout = {"a/0": (0, 1), "a/1": (2, 3), "b/0": (4,), "b/1": (5,), "c/0": (6, 7)}
    plan = plan_generation(view(slot_map=layout, dead=("c/0",), speeds=speeds,
                                losses={"c/0": Loss(1, "shard_reweight_failover", "c")}))
    # capacity a 2 x 3 : b 2 x 1; quotas 1.5 and 0.5, the tied remainder to the first region: a gets both
    got = {m: len(s) for m, s in plan.slot_map.items()}
    assert got == {"a/0": 3, "a/1": 3, "b/0": 1, "b/1": 1}


def test_a_straggler_is_parked_and_comes_back_with_its_own_slots():
    slow = {"b/0": WorkerView(committed=10, per_slot_s=0.5), "a/0": WorkerView(committed=10, per_slot_s=0.1),
            "a/1": WorkerView(committed=10, per_slot_s=0.1), "b/1": WorkerView(committed=10, per_slot_s=0.2),
            "c/0": WorkerView(alive=False)}
    plan = plan_generation(view(workers=slow, to_park={"b/0": 4}))
    assert plan.parked == {"b/0": [2]} and plan.moves == {4: [(2, "b/0", "a/0")]}
    assert "b/0" not in plan.slot_map
    back = {**slow, "b/0": WorkerView(committed=10, parked=(2,))}
    plan2 = plan_generation(view(slot_map={m: tuple(s) for m, s in plan.slot_map.items()}, workers=back,
                                 to_unpark={"b/0": 4}))
    assert plan2.unparked == ["b/0"] and plan2.slot_map == {"a/0": [0], "a/1": [1], "b/0": [2], "b/1": [3]}


def test_a_free_spare_takes_a_parked_stragglers_slots():
    plan = plan_generation(view(to_park={"b/0": None}))
    assert plan.slot_map["c/0"] == [2] and plan.moves == {None: [(2, "b/0", "c/0")]}


def test_the_survivors_are_behind_or_all_lost():
    behind = {n: WorkerView(committed=9) for n in NODES}
    plan = plan_generation(view(dead=("a/1",), workers=behind, losses={"a/1": Loss(0, "replicate_resume", "a/1")}))
    assert plan.failure and "state of step 10" in plan.failure
    gone = plan_generation(view(dead=NODES))
    assert gone.failure == "every worker is lost; nothing left to train on"
    ahead = {**behind, "b/1": WorkerView(committed=11)}  # a survivor committed a step the others did not
    assert plan_generation(view(workers=ahead)).start == 11


def test_episode_stages_move_forward_only():
    book = EpisodeBook()
    ep = book.new("network_jitter", "b/0", "backpressure_reslot", t=1.0)
    ep.nodes = ["b/0"]
    assert ep.stage is Stage.STRUCK and ep.open and book.jitter_on("b/0") is ep
    assert ep.detect(1.5) and not ep.detect(2.0) and ep.t_detect == 1.5
    assert ep.start_recovery() and not ep.start_recovery()
    ep.end_gen = 3
    assert not ep.due(2, None) and ep.due(3, None)
    ep.parked = True
    assert not ep.due(3, None)  # its straggler still stands by
    ep.stage = Stage.ENDED
    assert book.jitter_on("b/0") is None and book.due(5, None) == []
    data = book.new("data_shard_skew", "shard/3", "quarantine_resample", t=2.0)
    assert book.bad_shard([1, 3]) is data and book.bad_shard([2]) is None and data.fault_id == 1


def test_straggler_watch_needs_a_window_of_slow_steps_and_probes_to_come_back():
    watch = StragglerWatch(factor=1.5, window=3)
    reps = {"a/0": {"ready_s": 0.1, "slots": 1}, "a/1": {"ready_s": 0.1, "slots": 1}, "b/0": {"ready_s": 0.4, "slots": 1}}
    first = watch.judge(reps, may_park=True)
    assert [v.slow for v in first] == [False, False, True] and not any(v.park for v in first)
    watch.judge(reps, may_park=True)
    third = watch.judge(reps, may_park=True)
    assert third[-1].park and third[-1].node == "b/0"
    assert not watch.judge(reps, may_park=False)[-1].park  # checkpoint_restart: judged, never parked
    assert not watch.probe("b/0", 0.01) and not watch.probe("b/0", 0.01) and watch.probe("b/0", 0.01)
    watch.forget("b/0")
    assert "b/0" not in watch.slow and "b/0" not in watch.ok_probes


def test_stall_report_names_what_each_member_last_said():
    now = 100.0

    def w(role, alive=True, committed=4, ready_gen=1, at=None, last=None):
        return SimpleNamespace(role=role, alive=alive, committed=committed, ready_gen=ready_gen, at=at,
                               last_msg=last, last_msg_t=now - 59.0, last_hb_t=now - 0.05)
    workers = {"a/0": w("member", ready_gen=0, at="gen 1: state broadcast, sending"),
               "a/1": w("dead", alive=False),
               "b/0": w("member"), "b/1": w("member", last={"type": "ready", "gen": 1}),
               "c/0": w("member", committed=0, ready_gen=0, at="gen 1: state broadcast, receiving")}
    lines = stall_report(stall=60.0, phase="running", gen=1, committed=4, gen_start_step=4, nodes=NODES,
                         workers=workers, members=["a/0", "b/0", "b/1", "c/0"], next_reports={"b/0", "b/1"},
                         pending_acks=set(), now=now)
    assert lines[0].startswith("no progress for 60 s (phase running, generation 1, committed 4")
    by = {line.split(":", 1)[0].strip(): line for line in lines[1:]}
    assert "NOT ready" in by["c/0"] and "receiving" in by["c/0"] and "no report of step 5" in by["c/0"]
    assert "sending" in by["a/0"] and "NOT ready" in by["a/0"]
    assert "reported step 5" in by["b/0"] and "ready," in by["b/0"]
    assert "last message 'ready gen=1' 59." in by["b/1"]
    assert "dead" in by["a/1"]


@pytest.mark.parametrize("kind", ["hb", "joined", "step", "ready", "nonfinite", "aborted", "ckpt_start",
                                  "ckpt_end", "done", "error"])
def test_every_worker_message_the_protocol_declares_has_a_handler(kind):
    from runtime import protocol
    from runtime.coordinator.messages import HANDLERS
    assert kind in protocol.__doc__
    assert kind in HANDLERS


def test_a_spike_that_made_no_straggler_ends_with_the_spike():
    """As the twin ends it (recover_end when the spike is over), so both logs' episodes, and
    so the cost of the spike, span the same steps."""
    book = EpisodeBook()
    quiet = book.new("network_jitter", "ap", "backpressure_reslot", t=10.0)
    quiet.until = 30.0
    assert not quiet.due(1, 5, now=29.9) and quiet.due(1, 5, now=30.0)
    assert [ep.fault_id for ep in book.due(1, 5, now=31.0)] == [0]
    loud = book.new("network_jitter", "a/0", "backpressure_reslot", t=10.0)
    loud.until = 30.0
    loud.detect(12.0)  # a straggler: its episode ends by the straggler rule, not the clock
    assert not loud.due(1, 5, now=40.0)


def test_the_straggler_watch_survives_a_snapshot_by_name():
    """A successor's watch (snapshot.py) is the dead coordinator's, field by field."""
    import json
    speeds = {"a": 1.0, "b": 0.8, "c": 1.25}
    watch = StragglerWatch(1.5, 3, speeds)
    for _ in range(2):
        watch.judge({"a": {"ready_s": 0.1, "slots": 1}, "b": {"ready_s": 0.125, "slots": 1},
                     "c": {"ready_s": 0.5, "slots": 1}}, True)
    watch.probe("c", 0.0)
    back = StragglerWatch.restored(1.5, 3, speeds, json.loads(json.dumps(watch.state())))
    assert back == watch and back.slow["c"] == 2 and back.ok_probes["c"] == 1


def test_the_coordinator_and_the_worker_are_no_mixins():
    """Their state in plain view (issue 23): no mixin in runtime/coordinator/ nor in the worker's
    modules; the coordinator's decisions read and write one dataclass (state.py)."""
    import ast
    import dataclasses
    from pathlib import Path
    from runtime.coordinator.state import CoordinatorState
    root = Path(__file__).resolve().parents[1] / "runtime"
    files = [*(root / "coordinator").rglob("*.py"), *root.glob("worker*.py"), root / "emulation" / "worker.py"]
    mixed = [f"{p.name}:{c.name}" for p in files for c in ast.walk(ast.parse(p.read_text()))
             if isinstance(c, ast.ClassDef) and (c.name.endswith("Mixin") or len(c.bases) > 1)]
    assert mixed == []
    assert {"phase", "gen", "members", "slot_map", "committed", "book", "quarantine", "fired"} <= {
        f.name for f in dataclasses.fields(CoordinatorState)}
