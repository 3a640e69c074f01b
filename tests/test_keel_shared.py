"""What every tool shares from `keel`: the run directory (`keel.rundir`), the one JSON printer,
the statistics (`keel.stats`) and the paths (`keel.paths`)."""
from __future__ import annotations

import json
import math
import os
import statistics

import pytest

from keel import paths, rundir, stats
from keel.errors import InputError
from keel.events import Event

pytestmark = pytest.mark.timeout(60)

EVENTS = [
    Event(0.0, 0, "run_start"),
    Event(1.5, 1, "step"),
    Event(2.0, 1, "fault", "hardware_fault", "eu-west/3", "replicate_resume", {"fault_id": 0}),
    Event(3.25, 2, "step"),
    Event(3.25, 2, "run_end"),
]
SUMMARY = {"tool": "twin", "scenario": "tiny", "steps": 2, "goodput": 0.75, "restarts": 0,
           "faults": [{"fault_id": 0, "downtime_s": 1.25}]}


# ----------------------------------------------------------------------------- rundir

def test_write_run_round_trips_events_and_summary(tmp_path):
    out = rundir.write_run(tmp_path / "a" / "b", EVENTS, SUMMARY)
    assert out == tmp_path / "a" / "b"
    assert rundir.is_run_dir(out)
    assert rundir.read_summary(out) == SUMMARY
    assert rundir.read_events(out) == EVENTS
    # the layout every reader expects, and the summary as indented, sorted JSON
    assert sorted(p.name for p in out.iterdir()) == [rundir.EVENTS, rundir.SUMMARY]
    text = (out / rundir.SUMMARY).read_text()
    assert text.endswith("}\n") and text.count("\n") > 1
    assert list(json.loads(text)) == sorted(SUMMARY)


def test_write_run_replaces_an_earlier_run(tmp_path):
    rundir.write_run(tmp_path, EVENTS, SUMMARY)
    rundir.write_run(tmp_path, EVENTS[:2], {"steps": 1})
    assert rundir.read_events(tmp_path) == EVENTS[:2]  # a fresh log, not appended to
    assert rundir.read_summary(tmp_path) == {"steps": 1}


def test_write_summary_replaces_atomically(tmp_path, monkeypatch):
    rundir.write_summary(tmp_path, SUMMARY)
    rundir.write_summary(tmp_path, {**SUMMARY, "steps": 3})
    assert rundir.read_summary(tmp_path)["steps"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [rundir.SUMMARY]  # no temporary file left

    # a writer that dies before the rename leaves the old summary whole
    def crash(src, dst):
        raise OSError("killed mid-write")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed mid-write"):
        rundir.write_summary(tmp_path, {"steps": 99})
    monkeypatch.undo()
    assert rundir.read_summary(tmp_path)["steps"] == 3


def test_write_json_refuses_nan_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError):
        rundir.write_json(tmp_path / "x" / "plan.json", {"goodput": math.nan})
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
    path = rundir.write_json(tmp_path / "x" / "plan.json", {"b": 1, "a": [1, 2]})
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=1, sort_keys=True) + "\n"


def test_read_summary_names_the_file_and_the_problem(tmp_path):
    with pytest.raises(InputError, match=r"summary\.json: no such file"):
        rundir.read_summary(tmp_path)
    (tmp_path / rundir.SUMMARY).write_text("{not json")
    with pytest.raises(InputError, match=r"summary\.json: not valid JSON \(.* at line 1\)"):
        rundir.read_summary(tmp_path)
    (tmp_path / rundir.SUMMARY).write_text("[1, 2]")
    with pytest.raises(InputError, match=r"summary\.json: expected a JSON object"):
        rundir.read_summary(tmp_path)


def test_is_run_dir_needs_both_files(tmp_path):
    assert not rundir.is_run_dir(tmp_path)
    rundir.write_summary(tmp_path, SUMMARY)
    assert not rundir.is_run_dir(tmp_path)
    (tmp_path / rundir.EVENTS).write_text(EVENTS[0].to_json() + "\n")
    assert rundir.is_run_dir(tmp_path)
    assert not rundir.is_run_dir(tmp_path / rundir.SUMMARY)


def test_print_json_prints_one_sorted_line(capsys):
    rundir.print_json({"z": 1, "a": {"nested": [1, 2.5, None]}, "s": "two\nlines"})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.endswith("\n")
    assert out == json.dumps({"a": {"nested": [1, 2.5, None]}, "s": "two\nlines", "z": 1}, sort_keys=True) + "\n"
    with pytest.raises(ValueError):  # NaN is not JSON: refused, never printed
        rundir.print_json({"goodput": math.inf})
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- stats

def test_mean_ci95_is_student_t():
    mean, (lo, hi) = stats.mean_ci95([1.0, 2.0, 3.0, 4.0])
    # by hand: mean 2.5, s = sqrt(5/3) = 1.2910, t(0.975, 3 df) = 3.182, half = 3.182 s / 2
    assert mean == 2.5
    assert lo == pytest.approx(0.44603, abs=1e-5) and hi == pytest.approx(4.55397, abs=1e-5)
    # wider than the normal approximation's 1.96 for few values, the same for many
    assert hi - mean > 1.96 * math.sqrt(5 / 3) / 2
    many = [float(i % 7) for i in range(500)]
    m, (lo2, hi2) = stats.mean_ci95(many)
    assert hi2 - m == pytest.approx(1.96 * statistics.stdev(many) / math.sqrt(500))


def test_mean_ci95_of_one_value_is_a_point():
    assert stats.mean_ci95([0.9]) == (0.9, [0.9, 0.9])


def test_t95_table():
    assert stats.t95(1) == 12.706 and stats.t95(3) == 3.182 and stats.t95(10) == 2.228
    assert stats.t95(11) == 2.228  # between entries: the smaller df's, which is wider
    assert stats.t95(1000) == 1.96
    assert stats.t95(0) == math.inf


def test_range95_interpolates_percentiles():
    assert stats.range95([5.0, 1.0, 4.0, 2.0, 3.0]) == pytest.approx([1.1, 4.9])
    assert stats.range95([7.0]) == [7.0, 7.0]
    assert stats.range95([1.0, 3.0]) == pytest.approx([1.05, 2.95])
    ys = [float(x * x % 13) for x in range(41)]
    ys_sorted = sorted(ys)
    lo, hi = stats.range95(ys)
    # numpy's default (linear) percentile, computed by hand: k = p (n - 1)
    assert lo == pytest.approx(ys_sorted[1])  # 0.025 * 40 = 1
    assert hi == pytest.approx(ys_sorted[39])  # 0.975 * 40 = 39


# ----------------------------------------------------------------------------- paths

def test_paths_point_at_the_bundled_scenarios():
    assert (paths.REPO_ROOT / "pyproject.toml").is_file()
    assert paths.DEFAULT_SCENARIO.is_file() and paths.DEFAULT_SCENARIO.parent == paths.SCENARIOS
    assert paths.LOCAL_SCENARIO.is_file() and paths.LOCAL_SCENARIO.parent == paths.SCENARIOS
