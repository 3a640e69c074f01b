"""The sweep's report (bench/validate_sweep.py): where a member's time went, from what its
validation wrote, and the report's line for it. The sweep itself is a benchmark."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("validate_sweep", ROOT / "bench" / "validate_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _member(tmp_path: Path, name: str, calibration_s: float, written: float, reps_end: float) -> Path:
    vdir = tmp_path / name
    (vdir / "runtime" / "rep-0").mkdir(parents=True)
    (vdir / "runtime" / "rep-1").mkdir()
    cal = vdir / "calibration.json"
    cal.write_text(json.dumps({"duration_s": calibration_s}))
    os.utime(cal, (written, written))
    for k, end in ((0, reps_end - 40.0), (1, reps_end)):
        p = vdir / "runtime" / f"rep-{k}" / "summary.json"
        p.write_text("{}")
        os.utime(p, (end, end))
    return vdir


def test_a_member_s_time_splits_into_calibration_repetitions_and_the_rest(tmp_path):
    vdir = _member(tmp_path, "m", calibration_s=105.3, written=1000.0, reps_end=1071.7)
    assert sweep.time_parts(vdir, 185.4) == {"calibration_s": 105.3, "repetitions_s": 71.7, "other_s": 8.4}
    assert sweep.time_parts(tmp_path / "nothing", 10.0) is None  # refused before anything ran


def test_the_report_says_where_the_sweep_s_time_went(tmp_path):
    base = {"features": {"policy": "absorb", "faults": ["NaN shard"]}, "verdict": "pass", "time_scale": 0.5, "faults": [],
            "tolerances": {"downtime_rel_tol": 0.1, "fault_rel_tol": 0.15, "wall_rel_tol": 0.05},
            "downtime_median_rel_err": 0.01, "wall_rel_err": 0.01, "step_rel_err": 0.0}
    records = [{**base, "index": 0, "name": "sweep-1-0", "seconds": 200.0,
                "time": {"calibration_s": 50.0, "repetitions_s": 140.0, "other_s": 10.0}},
               {**base, "index": 1, "name": "sweep-1-1", "seconds": 100.0, "time": None}]
    s = sweep.summarise(records, 1)
    assert s["seconds"] == 300.0 and s["time_parts"]["members"] == 1
    text = sweep.markdown(records, s)
    assert ("time: 5 min (150 s a member); of the 1 members timed part by part: calibration 25%, runtime "
            "repetitions 70%, the rest (probe, twin, start-up) 5%") in text
    assert "| 200 s (calibration 50, repetitions 140) |" in text and "| 100 s |" in text
