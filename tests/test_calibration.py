"""Calibration without processes: the file format (keel/calibration.py) and the pure fitting
(planner/calibrate_fit.py) on fixed samples and hand-made event logs with known answers. The
expected figures are those the fitting gave before it was split out of planner/calibrate.py."""
import dataclasses
import json

import pytest

from conftest import SCENARIOS
from keel import calibration as K
from keel import scenario as S
from keel.events import Event
from planner import calibrate_fit as F

LOCAL = SCENARIOS / "local-8.toml"


def E(t, step, kind, fault=None, target=None, action=None, **detail):
    return Event(t, step, kind, fault, target, action, detail)


def samples(pace=None, **recovery):
    """Fixed samples as `planner.calibrate.measure` returns them (7 training workers)."""
    group = [{"rank": r, "slot_compute_s": [0.004, 0.005, 0.006 + 0.001 * r],
              "reduce": {n: [0.001 + 1e-5 * r + n * 1e-8 * (1 + 0.1 * i) for i in range(3)]
                         for n in (100_000, 200_000, 400_000)},
              "state_bytes": 2_000_000, "state_transfer_s": [0.002, 0.004, 0.001 * (r + 1)]}
             for r in range(7)]
    ckpt = {"ckpt_snapshot_gbyte_s": [2.0, 3.0, 4.0], "ckpt_write_gbyte_s": [0.5, 0.4, 0.6],
            "ckpt_read_gbyte_s": [1.0, 1.5, 1.25]}
    rec = {"detect_kill_s": [0.03, 0.05, 0.04], "detect_hang_s": [0.9, 1.1, 1.0], "detect_rack_s": [0.06, 0.08],
           "reform_s": [0.1, 0.12, 0.11], "spare_takeover_s": [0.01, 0.02, 0.0], "restart_s": [2.5],
           "spike_rounds": [1.0, 1.2], "spike_tail_s": [0.02, 0.03, 0.01], "step_time_s": [0.11, 0.1, 0.12],
           **recovery}
    return {"micro": {"group": group, "checkpoint": ckpt},
            "pace": {7: 0.1, 5: 0.08, 3: 0.075} if pace is None else pace, "recovery": rec}


def test_fit_from_fixed_samples():
    fitted = F.fit_calibration(samples(), S.load(LOCAL))
    p = fitted["primitives"]
    assert {k: e["median"] for k, e in p.items()} == pytest.approx({
        "ckpt_read_gbyte_s": 1.25, "ckpt_snapshot_gbyte_s": 3.0, "ckpt_write_gbyte_s": 0.5,
        "detect_hang_s": 1.0, "detect_kill_s": 0.04, "detect_rack_s": 0.07,
        "host_pace_per_worker": 0.06410256410256412, "reduce_gbyte_s": 0.09090909090909091,
        "reduce_latency_s": 0.00106, "reform_s": 0.11, "restart_s": 2.5, "slot_compute_s": 0.005,
        "spare_takeover_s": 0.01, "spike_rounds": 1.1, "spike_tail_s": 0.02, "state_transfer_gbyte_s": 0.5,
        "step_overhead_s": 0.0877257142857143}, rel=1e-12)
    assert fitted["missing"] == []
    assert fitted["pace"] == {"step_time_s_by_workers": {"3": 0.075, "5": 0.08, "7": 0.1},
                              "fit": {"intercept_s": pytest.approx(0.05375), "per_worker_s": pytest.approx(0.00625)}}
    # every record is keel.calibration.entry's, with its unit and samples
    for name, e in p.items():
        assert e["unit"] == K.unit(name) and e["n"] == len(e["samples"]) and e["spread"][0] <= e["median"]
    assert p["slot_compute_s"]["n"] == 21 and p["reduce_latency_s"]["world_size"] == 7
    assert p["reduce_latency_s"]["micro_benchmark"]["median"] == pytest.approx(0.00106)
    assert p["reduce_latency_s"]["median_s_per_gradient_bytes"] == pytest.approx(
        {"100000": 0.00216, "200000": 0.00326, "400000": 0.00546})
    assert p["state_transfer_gbyte_s"]["bytes"] == 2_000_000
    assert p["host_pace_per_worker"]["workers"] == [3, 5, 7]
    json.dumps(fitted, allow_nan=False)


def test_fit_scales_a_slower_benchmark_to_the_measured_step():
    """One worker count: no host pace; the benchmarked reduction (6.56 ms) is slower than the
    step leaves for it (15 ms - 2 slots x 5 ms), so it is scaled down and there is no overhead."""
    fitted = F.fit_calibration(samples(pace={7: 0.015}, detect_rack_s=[], spike_rounds=[], restart_s=[]),
                               S.load(LOCAL))
    p = fitted["primitives"]
    assert p["reduce_latency_s"]["median"] == pytest.approx(0.0008079268292682926, rel=1e-12)
    assert p["reduce_gbyte_s"]["median"] == pytest.approx(0.11927272727272731, rel=1e-12)
    assert p["step_overhead_s"]["median"] == 0.0
    assert fitted["missing"] == ["restart_s"] and fitted["pace"]["fit"] is None
    assert not {"host_pace_per_worker", "detect_rack_s", "spike_rounds"} & set(p)


def absorb_log():
    """A kill (spare takes over), a spike found as a straggler, a rack loss: 0.1 s a step."""
    ev = [E(0.0, 0, "run_start")] + [E(0.1 * k, k, "step", gen=0) for k in range(1, 6)]
    ev += [E(0.52, 5, "fault", "hardware_fault", "a/1", "replicate_resume", fault_id=0, mode="kill"),
           E(0.55, 5, "detect", "hardware_fault", "a/1", "replicate_resume", fault_id=0),
           E(0.75, 5, "recover_end", "hardware_fault", "a/1", "replicate_resume", fault_id=0, gen=1, redo_s=0.07)]
    ev += [E(0.75 + 0.1 * (k - 5), k, "step", gen=1) for k in range(6, 10)]          # gen 1: 0.1 s a step
    ev += [E(1.1, 9, "fault", "network_jitter", "a/3", fault_id=1),
           E(1.45, 10, "step", gen=1),
           E(1.45, 10, "detect", "network_jitter", "a/3", "backpressure_reslot", fault_id=1,
             per_slot_s=0.3, median_per_slot_s=0.05)]
    ev += [E(1.45 + 0.1 * (k - 10), k, "step", gen=2) for k in range(11, 14)]
    ev += [E(1.8, 13, "fault", "partial_cluster_loss", "b", fault_id=2, mode="external"),
           E(1.86, 13, "detect", "partial_cluster_loss", "b", fault_id=2),
           E(2.0, 13, "recover_end", "partial_cluster_loss", "b", fault_id=2, gen=3)]
    ev += [E(2.0 + 0.12 * (k - 13), k, "step", gen=3) for k in range(14, 18)]        # gen 3: 0.12 s a step
    return ev + [E(2.5, 17, "run_end", step_time_s=0.1)]


def test_run_samples_from_an_absorb_log():
    out = F.run_samples(absorb_log(), 0.1, seed=1, spike_target="a/3", spike_s=0.15,
                        per_slot_copy_s=0.01, slot_compute_s=0.005)
    assert out["detect_kill_s"] == pytest.approx([0.03]) and out["detect_rack_s"] == pytest.approx([0.06])
    assert out["detect_hang_s"] == []
    # pause = recover_end - detect - the next generation's mean step - the state copy
    kill, rack = 0.75 - 0.55 - 0.1 - 0.01, 2.0 - 1.86 - 0.12 - 0.01
    assert out["reform_s"] == pytest.approx([rack]) and out["spare_takeover_s"] == pytest.approx([kill - rack])
    drawn = 0.15 * S.spike_factor(1, "a/3", 9)
    assert out["spike_rounds"] == pytest.approx([0.25 / drawn])
    assert out["spike_tail_s"] == pytest.approx([(1.45 - 1.15) - 0.25 - 0.005])


def test_restart_samples_and_generation_pace():
    ev = [E(0.1 * k, k, "step", gen=0) for k in range(1, 5)]
    ev += [E(0.45, 4, "fault", "hardware_fault", "a/1", fault_id=0),
           E(0.5, 4, "restart", "hardware_fault", "a/1", "checkpoint_restart", fault_id=0),
           E(3.0, 2, "recover_end", "hardware_fault", "a/1", "checkpoint_restart", fault_id=0)]
    ev += [E(3.0 + 0.1 * (k - 2), k, "step", gen=1) for k in range(3, 8)]
    assert F.restart_samples(ev, 0.1) == pytest.approx([3.1 - 0.5 - 0.1])
    assert F.generation_mean_step_s(ev, 1) == pytest.approx(0.1)
    assert F.generation_mean_step_s(ev, 0) == pytest.approx(0.1)  # stops at the fault
    assert F.generation_mean_step_s(ev, 5) is None


def test_pace_split_and_affine_fit():
    assert F.fit_affine([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))
    assert F.pace_split(0.1, 0.04, 0.01, 1.0, 1e7) == pytest.approx((1.0, 0.04))   # 20 ms micro, 60 ms left
    assert F.pace_split(0.05, 0.04, 0.01, 1.0, 1e7) == pytest.approx((0.5, 0.0))   # 10 ms left of 20


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
        "compute_jitter", "heartbeat_s", "replace_node_s", "calibrated"}
    assert set(K.NAMES) == primitives


def test_refresh_pace_keeps_everything_else():
    sc = S.load(LOCAL)
    cal = {"machine": {"hostname": "h"},
           "primitives": {"slot_compute_s": {"median": 0.005, "unit": "s"}, "reform_s": {"median": 0.1},
                          "reduce_latency_s": {"median": 0.02}, "reduce_gbyte_s": {"median": 0.05}}}
    out = F.refresh_pace(cal, sc, 0.1, "test")
    assert out["machine"] == cal["machine"] and out["primitives"]["reform_s"] == {"median": 0.1}
    assert out["primitives"]["step_overhead_s"]["refreshed"]["how"] == "test"
    assert out["primitives"]["step_overhead_s"]["unit"] == "s" and "refreshed" not in cal["primitives"]["reduce_gbyte_s"]
