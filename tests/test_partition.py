"""`network_partition` (issue 27): a node or a region cut off, found only by the heartbeat
timeout, absorbed as the loss of its nodes. The twin's timing, the scenario's rules, and the
runtime for real: worker processes frozen mid-run (no connection reset), 0 restarts, final
weights bit-identical to the fault-free run."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import twin
from keel.scenario import ScenarioError, load, loads
from runtime_helpers import kinds, run, scenario_text

REPO = Path(__file__).resolve().parents[1]
STEPS = 14


def cut(at_step: int, target: str, duration_s: float | None = None) -> dict:
    f = {"at_step": at_step, "class": "network_partition", "target": target}
    if duration_s is not None:
        f["duration_s"] = duration_s
    return f


def partition_events(result, fault_id: int):
    return {e.kind: e for e in result.events if e.detail.get("fault_id") == fault_id}


# ----------------------------------------------------------------------------- the twin

def test_the_twin_finds_a_cut_by_the_timeout_whatever_the_calibration_measured():
    """A crash seen as connection loss may be found fast (a calibrated detect_kill_s); a cut
    resets nothing, so the whole detect_timeout_s runs from its last message (its step report,
    for a cut struck right after a commit)."""
    sc = loads(scenario_text(faults=[cut(4, "b")], detect_timeout_s=2.0), "<partition>")
    fast = {"primitives": {"detect_kill_s": {"median": 0.05}, "detect_rack_s": {"median": 0.05}}}
    for calibration in (None, fast):
        ev = partition_events(twin.simulate(sc, calibration=calibration), 0)
        assert ev["detect"].t - ev["fault"].t == pytest.approx(2.0)
        assert ev["fault"].detail["nodes"] == ["b/0", "b/1"]
        assert ev["reslot"].step == 4  # the in-flight step is lost, nothing committed beyond it
    crash = loads(scenario_text(faults=[{"at_step": 4, "class": "partial_cluster_loss", "target": "b",
                                         "nodes": 2}], detect_timeout_s=2.0), "<crash>")
    ev = partition_events(twin.simulate(crash, calibration=fast), 0)
    assert ev["detect"].t - ev["fault"].t < 0.2  # the calibrated 0.05 s, +- half a heartbeat


def test_a_cut_region_s_slots_go_to_the_other_regions_and_its_nodes_rejoin_after_the_heal():
    text = scenario_text(steps=400, faults=[cut(4, "b", 30.0)],
                         extra="[faults.network_partition]\nrejoin_hours = 0.001\n")
    sc = loads(text, "<partition>")
    res = twin.simulate(sc)
    ev = partition_events(res, 0)
    to = {dst.split(":")[0] for dst in ev["reslot"].detail["to"]}
    assert to and not any(n.startswith("b/") for n in to)
    # back as spares 30 s + 3.6 s after the cut, then they take their share again
    back = [e for e in res.events if e.kind == "reslot" and e.detail.get("reason") == "rejoin"]
    assert back and back[0].t >= ev["fault"].t + 33.6
    assert {dst.split(":")[0] for dst in back[0].detail["to"]} == {"b/0", "b/1"}
    never = twin.simulate(loads(text.replace("duration_s = 30.0", "duration_s = 0.0"), "<no heal>"))
    assert not [e for e in never.events if e.kind == "reslot" and e.detail.get("reason") == "rejoin"]


def test_drawn_cuts_take_one_live_node_and_are_found_about_a_timeout_later():
    text = scenario_text(steps=3000, extra="[faults.network_partition]\nper_day = 2000.0\nduration_s = 0.0\n")
    res = twin.simulate(loads(text, "<drawn>"))
    faults = [e for e in res.events if e.kind == "fault" and e.fault == "network_partition"]
    assert faults and all(len(e.detail["nodes"]) == 1 for e in faults)
    detects = [e for e in res.events if e.kind == "detect" and e.fault == "network_partition"]
    # policy: heartbeat 0.1 s, timeout 1.0 s: found 0.95 s +- 0.05 s after a cut at a random moment
    assert detects and all(0.9 - 1e-9 <= e.detail["after_s"] <= 1.0 + 1e-9 for e in detects)


# ----------------------------------------------------------------------------- the scenario

@pytest.mark.parametrize("entry, key", [
    (cut(3, "b", 0.5), "faults.schedule.0.duration_s"),   # heals before the 1 s timeout finds it
    (cut(3, "b", -1.0), "faults.schedule.0.duration_s"),
    (cut(3, "z"), "faults.schedule.0.target"),
    (cut(3, "b/7"), "faults.schedule.0.target"),
])
def test_a_bad_scheduled_cut_names_its_key(entry, key):
    with pytest.raises(ScenarioError, match=f"key '{key}'"):
        loads(scenario_text(faults=[entry]), "<bad>")


def test_a_drawn_cut_that_heals_before_it_is_found_is_refused():
    text = scenario_text(extra="[faults.network_partition]\nper_day = 1.0\nduration_s = 0.2\n")
    with pytest.raises(ScenarioError, match="key 'faults.network_partition.duration_s'.*stall"):
        loads(text, "<bad>")
    loads(text.replace("per_day = 1.0", "per_day = 0.0"), "<off>")  # off: its duration is not used


def test_the_packaged_partition_scenario_loads_and_its_cuts_outlast_detection():
    sc = load(REPO / "scenarios/partition-12.toml")
    cuts = [e for e in sc.faults.schedule if e.class_ == "network_partition"]
    assert {e.target for e in cuts} == {"us-east/2", "ap-southeast"}


# ----------------------------------------------------------------------------- the runtime

@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    summary, _ = run(tmp_path_factory.mktemp("base"), "base", steps=STEPS)
    return summary


@pytest.mark.timeout(180)
def test_a_region_cut_off_is_absorbed_bit_identically(tmp_path, baseline):
    summary, events = run(tmp_path, "cut", steps=STEPS, faults=[cut(5, "b")])
    assert summary["restarts"] == 0 and len(summary["faults"]) == 1
    assert summary["faults"][0]["action"] == "shard_reweight_failover"
    assert summary["losses"] == baseline["losses"]
    assert summary["final_weights_sha256"] == baseline["final_weights_sha256"]
    ks = kinds(events, 0)
    assert ks[0] == "fault" and "recover_end" in ks
    detects = [e for e in events if e.kind == "detect" and e.fault_id == 0]
    assert len(detects) == 2  # both of the region's workers, each by its silence
    assert all(e.detail["how"].startswith("no heartbeat") and e.detail["detect_s"] >= 0.9 for e in detects)
    reslot = next(e for e in events if e.kind == "reslot" and e.fault_id == 0)
    assert {dst for _, _, dst in reslot.detail["moves"]} <= {"a/0", "a/1", "c/0"}
    for node, pids in summary["pids"].items():  # nobody outside the cut was restarted
        assert len(pids) == 1 or node.startswith("b/"), (node, pids)


@pytest.mark.timeout(180)
def test_a_node_cut_that_heals_later_is_absorbed_bit_identically(tmp_path, baseline):
    summary, events = run(tmp_path, "heal", steps=STEPS, faults=[cut(4, "a/1", 1.5)])
    assert summary["restarts"] == 0
    assert summary["losses"] == baseline["losses"]
    assert summary["final_weights_sha256"] == baseline["final_weights_sha256"]
    detect = next(e for e in events if e.kind == "detect" and e.fault_id == 0)
    assert detect.detail["how"].startswith("no heartbeat")


@pytest.mark.timeout(60)
def test_a_worker_freezes_itself_and_wakes_at_the_heal():
    """The path of a worker no local coordinator spawned (runtime/worker_process.freeze_self):
    stopped for real, then continued by its waker."""
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from runtime.worker_process import freeze_self\n"
            "t = time.monotonic(); freeze_self(1.0); print(round(time.monotonic() - t, 2), flush=True)\n") % str(REPO)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        state = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and state != "T":
            time.sleep(0.02)
            state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T", "the worker never stopped"
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
    assert proc.returncode == 0 and float(out) >= 0.9


# ----------------------------------------------------------------------------- what a cut-off worker leaves

def test_a_checkpoint_is_published_only_once_the_coordinator_confirmed_its_step(tmp_path):
    """A worker cut off from its coordinator applies steps ahead, in memory; its checkpoint of
    such a step is written, then waits before the rename that publishes it: published once the
    coordinator confirms the step, dropped (no directory left) when the wait is given up."""
    import threading
    import torch
    from runtime import checkpoint as ck
    from runtime.checkpoint_read import find_latest
    from runtime.worker_link import CoordinatorLink, Unconfirmed
    model = torch.nn.Linear(3, 2)
    args = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rng=ck.capture_rng(),
                data_state={}, config_hash="0" * 64, config={}, topology={})
    link = CoordinatorLink("198.18.0.1:29400", chan=None, silence_s=6.0)
    link.confirm(4)
    ck.save_checkpoint(tmp_path, step=4, before_commit=lambda: link.await_confirmed(4, lambda: True), **args)
    give_up = threading.Event()
    threading.Timer(0.3, give_up.set).start()
    with pytest.raises(Unconfirmed, match="has not confirmed step 8"):
        ck.save_checkpoint(tmp_path, step=8, before_commit=lambda: link.await_confirmed(8, give_up.is_set), **args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]  # nothing of step 8, no leftover
    threading.Timer(0.3, link.confirm, args=(8,)).start()
    t0 = time.monotonic()
    path = ck.save_checkpoint(tmp_path, step=8, before_commit=lambda: link.await_confirmed(8, lambda: False), **args)
    assert time.monotonic() - t0 >= 0.25 and find_latest(tmp_path) == path


def test_the_coordinator_confirms_at_once_the_steps_a_checkpoint_waits_on():
    from runtime.protocol import CONFIRM_EVERY_STEPS, confirm_due
    assert confirm_due(20, 19, checkpoint_interval=10)  # a checkpoint step: its writer is waiting
    assert not confirm_due(21, 20, checkpoint_interval=10)
    assert not confirm_due(20, 20, checkpoint_interval=10)  # already said
    assert confirm_due(20 + CONFIRM_EVERY_STEPS, 20, checkpoint_interval=1000)  # the commit lead
