"""Calibration without processes: the file format (keel/calibration.py) and the pure fitting
(planner/calibrate_fit.py) on hand-made event logs with known answers."""
import dataclasses
import json

import pytest

from keel import calibration as K
from keel.events import Event
from planner import calibrate_fit as F

def E(t, step, kind, fault=None, target=None, action=None, **detail):
    return Event(t, step, kind, fault, target, action, detail)


def _episode(ev, fid, cls, target, t_fault, t_reslot, t_end, gen, state_s, step):
    ev += [E(t_fault, step, "fault", cls, target, fault_id=fid),
           E(t_fault + 0.5, step, "detect", cls, target, fault_id=fid),
           E(t_reslot, step, "reslot", cls, target, fault_id=fid, gen=gen),
           E(t_end, step, "recover_end", cls, target, fault_id=fid, gen=gen, state_s=state_s)]


def calibration_log():
    """An emulated calibration run: a kill at step 3 (a spare takes over), a rack loss at 7;
    fault-free steps of 1.0 s, 1.2 s after the kill, 1.5 s after the rack loss."""
    ev = [E(float(k), k, "step", gen=0) for k in range(1, 4)]
    _episode(ev, 0, "hardware_fault", "a/1", 3.0, 8.0, 12.0, 1, 0.2, 3)    # pause 12 - 8 - 0.2 - 1.2
    ev += [E(12.0 + 1.2 * (k - 4), k, "step", gen=1) for k in range(4, 8)]
    _episode(ev, 1, "partial_cluster_loss", "c", 15.6, 20.6, 24.0, 2, 0.0, 7)  # pause 24 - 20.6 - 1.5
    ev += [E(24.0 + 1.5 * (k - 8), k, "step", gen=2) for k in range(8, 11)]
    return ev


def test_pauses_and_samples_from_a_calibration_log():
    ev = calibration_log()
    p = F.pauses(ev)
    assert p == pytest.approx({"kill": 12.0 - 8.0 - 0.2 - 1.2, "rack": 24.0 - 20.6 - 1.5})
    out = F.run_samples(ev)
    assert out["reform_s"] == pytest.approx([1.9]) and out["spare_takeover_s"] == pytest.approx([2.6 - 1.9])
    # a run that lost no rack gives no sample (the take-over is measured against the re-forming)
    assert F.run_samples([e for e in ev if e.fault_id != 1]) == {"reform_s": [], "spare_takeover_s": [],
                                                                 "coordinator_restart_s": [],
                                                                 "coordinator_reform_s": []}


def with_coordinator_loss(ev, fid, t_dead, ack_s, pg_s, step_s, step, policy="absorb"):
    """A coordinator killed after the commit of `step`, as the runtime logs it (the contract of
    issue 13): fault, detect, recover_start; under absorb the steps the workers trained during
    the outage committed at once, then recover_end just before the new generation's first
    commit; under checkpoint_restart a restart instead."""
    action = "coordinator_failover" if policy == "absorb" else "checkpoint_restart"
    ev += [E(t_dead, step, "fault", "coordinator_loss", "coordinator", action, fault_id=fid, mode="kill"),
           E(t_dead + 0.01, step, "detect", "coordinator_loss", "coordinator", action, fault_id=fid, detect_s=0.01),
           E(t_dead + 0.01, step, "recover_start", "coordinator_loss", "coordinator", action, fault_id=fid)]
    if policy != "absorb":
        ev += [E(t_dead + ack_s, step, "restart", "coordinator_loss", "coordinator", action, fault_id=fid,
                 from_step=0, lost_steps=step, checkpoint=None),
               E(t_dead + ack_s + 5.0, 0, "recover_end", "coordinator_loss", "coordinator", action, fault_id=fid,
                 from_step=0)]
        return
    trained = int(ack_s // step_s)  # the workers train on meanwhile
    ev += [E(t_dead + ack_s, step + trained, "step", gen=2)]
    end = t_dead + ack_s + pg_s + step_s
    ev += [E(end, step + trained, "recover_end", "coordinator_loss", "coordinator", action, fault_id=fid,
             downtime_s=end - t_dead, detect_s=0.01, ack_s=ack_s, reform_s=ack_s + pg_s, state_s=0.0,
             redo_s=step_s, gen=3),
           E(end, step + trained + 1, "step", gen=3)]


def test_coordinator_restart_s_is_the_runtimes_ack_s():
    ev = calibration_log()
    with_coordinator_loss(ev, 2, 29.0, 3.2, 0.3, 1.5, 10)
    out = F.run_samples(ev)
    assert out["coordinator_restart_s"] == pytest.approx([3.2])
    # the group the successor forms, on its own: reform_s - ack_s (not the rack loss's 1.9)
    assert out["coordinator_reform_s"] == pytest.approx([0.3])
    assert out["reform_s"] == pytest.approx([1.9])  # the rack loss's generation ends at the coordinator's fault
    # under checkpoint_restart the episode has no ack_s: no sample
    restart = calibration_log()
    with_coordinator_loss(restart, 2, 29.0, 3.2, 0.3, 1.5, 10, policy="checkpoint_restart")
    assert F.run_samples(restart)["coordinator_restart_s"] == F.run_samples(restart)["coordinator_reform_s"] == []
    fitted = F.fit_calibration({"coordinator_restart_s": [3.2, 2.8, 3.0, 9.0]})
    e = fitted["primitives"]["coordinator_restart_s"]
    assert e["median"] == pytest.approx(3.1) and e["unit"] == "s" and "ack_s" in e["how"]
    assert set(fitted["missing"]) == {"reform_s", "spare_takeover_s", "coordinator_reform_s"}


def test_the_coordinator_dies_with_every_trained_node_in_the_group():
    """The calibration's coordinator loss comes after the kill's episode and before the region
    loss, so its successor re-forms a group the size a validation's coordinator loss mostly
    finds (killed after the region loss, it timed a smaller group's re-form: sweep member 2/5,
    0.47 s against 1.0-1.2 s). Each fault is FAULT_GAP_STEPS or more after the one before, and
    the run goes on past the last."""
    from keel import scenario as S
    from planner import calibrate as C
    from planner.scenario_gen import FAULT_GAP_STEPS
    sc = C.calibration_scenario(S.load("scenarios/multiregion-12.toml"))
    at = {f.class_: f.at_step for f in sc.faults.schedule}
    assert at["hardware_fault"] < at["coordinator_loss"] < at["partial_cluster_loss"] < sc.run.steps
    assert at["partial_cluster_loss"] - at["coordinator_loss"] >= FAULT_GAP_STEPS
    assert sc.run.steps - at["partial_cluster_loss"] >= 4
    assert sc.policy.straggler_window > sc.run.steps  # no straggler moves next to a measured re-form


def test_fit_pools_the_runs_samples():
    fitted = F.fit_calibration({"reform_s": [1.9, 2.1, 2.0], "spare_takeover_s": [0.5, 0.7],
                                "coordinator_restart_s": [1.0], "coordinator_reform_s": [0.4]})
    p = fitted["primitives"]
    assert p["reform_s"]["median"] == pytest.approx(2.0) and p["spare_takeover_s"]["median"] == pytest.approx(0.6)
    for name, e in p.items():
        assert e["unit"] == K.unit(name) == "s" and e["n"] == len(e["samples"]) and e["how"]
    assert fitted["missing"] == []
    assert F.fit_calibration({"reform_s": [1.0]})["missing"] == ["spare_takeover_s", "coordinator_restart_s",
                                                                 "coordinator_reform_s"]


def test_generation_pace():
    ev = [E(0.1 * k, k, "step", gen=0) for k in range(1, 5)]
    ev += [E(0.45, 4, "fault", "hardware_fault", "a/1", fault_id=0)]
    ev += [E(3.0 + 0.1 * (k - 2), k, "step", gen=1) for k in range(3, 8)]
    assert F.generation_mean_step_s(ev, 1) == pytest.approx(0.1)
    assert F.generation_mean_step_s(ev, 0) == pytest.approx(0.1)  # stops at the fault
    assert F.generation_mean_step_s(ev, 5) is None


# ----------------------------------------------------------------------------- the file

def test_file_round_trip_and_checks(tmp_path):
    cal = {"format": K.FORMAT, "format_version": K.FORMAT_VERSION,
           "primitives": {"reform_s": K.entry([0.1, 0.3, 0.2], "s", how="test")}}
    path = K.write(cal, tmp_path / "sub" / K.FILENAME)
    assert path.read_text() == json.dumps(cal, indent=1, sort_keys=True) + "\n"
    assert K.load(path) == cal and K.medians(cal) == {"reform_s": 0.2}
    assert K.median(cal, "reform_s") == 0.2 and K.median(cal, "restart_s") is None and K.median(None, "x") is None
    with pytest.raises(K.CalibrationError, match="no such calibration file"):
        K.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(K.CalibrationError, match="not valid JSON"):
        K.load(tmp_path / "bad.json")
    for bad, message in (({"primitives": {"reform_s": 1}}, "'primitives.reform_s.median': missing"),
                         ({"primitives": {"reform_s": {"median": -1}}}, "non-negative"),
                         ({"primitives": {"reduce_gbyte_s": {"median": 0}}}, "positive"),
                         ({"primitives": {"reform_s": {"median": True}}}, "finite number"),
                         ({"primitives": []}, "key 'primitives'"), ([], "JSON object")):
        with pytest.raises(K.CalibrationError, match=message):
            K.medians(bad, "cal.json")
    assert K.medians({"primitives": {"unknown_s": {"median": "x"}}}) == {}  # names it does not know: ignored


def test_the_twin_reads_every_name_the_file_has():
    from twin.params import TwinParams
    primitives = {f.name for f in dataclasses.fields(TwinParams)} - {
        "compute_jitter", "heartbeat_s", "replace_node_s", "calibrated", "detect_at_commit_s"}
    assert set(K.NAMES) == primitives


def test_checkpoint_restart_has_nothing_to_measure_and_runs_nothing(monkeypatch):
    """Under checkpoint_restart every recovery is a relaunch timed by policy.restart_s: its
    runs yield none of the primitives (sweep members 1/3 and 1/4: every one missing, after
    220-245 s of relaunches), so calibrate says so and starts nothing."""
    from keel.paths import DEFAULT_SCENARIO
    from keel.scenario import load
    from planner import calibrate as C

    def no_run(*a, **k):
        raise AssertionError("a calibration run was started")

    monkeypatch.setattr(C, "measure", no_run)
    base = load(DEFAULT_SCENARIO).with_overrides({"policy.kind": "checkpoint_restart"})
    cal = C.calibrate(base=base, progress=False)
    assert cal["missing"] == list(F.RUN_KEYS) and cal["primitives"] == {}
    assert cal["reference"]["runs"] == 0 and cal["reference"]["nodes"] == base.total_nodes
