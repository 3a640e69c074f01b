"""`keel simulate`: --json, the human headline, --out, --replicas, and exit 2 on bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cli import main
from keel.events import read_events
from keel.metrics import summarize

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
LOCAL = str(ROOT / "scenarios" / "local-8.toml")
MULTIREGION = str(ROOT / "scenarios" / "multiregion-46.toml")


def test_json_prints_one_object_and_nothing_else(capsys):
    assert main(["simulate", LOCAL, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    summary = json.loads(out)
    assert summary["tool"] == "twin" and summary["scenario"] == "local-8" and summary["restarts"] == 0
    assert len(summary["faults"]) == 4


def test_headline_and_fault_table(capsys):
    assert main(["simulate", MULTIREGION]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("multiregion-46: 46 nodes, 4 regions, 4 scheduled + ")
    assert "faults absorbed, 0 restarts, goodput 0.9" in out[0]
    assert out[1].split()[:4] == ["id", "t", "(h)", "step"]
    assert "us-east/3" in out[2] and "replicate_resume" in out[2]


def test_out_writes_events_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", LOCAL, "--set", "run.steps=50", "--seed", "5", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "summary.json").read_text())
    assert printed == written and written["seed"] == 5 and written["steps"] == 50
    events = read_events(out / "events.jsonl")
    metrics = summarize(events)
    assert metrics["goodput"] == written["goodput"] and metrics["faults"] == written["faults"]
    # rerunning into the same directory replaces the log, byte for byte
    first = (out / "events.jsonl").read_bytes()
    assert main(["simulate", LOCAL, "--set", "run.steps=50", "--seed", "5", "--out", str(out), "--json"]) == 0
    assert (out / "events.jsonl").read_bytes() == first


def test_replicas_report_mean_and_ci_with_progress_on_stderr():
    proc = subprocess.run([sys.executable, "-m", "keel.cli", "simulate", LOCAL, "--replicas", "3", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["replicas"] == 3 and len(summary["summaries"]) == 3
    low, high = summary["goodput_ci95"]
    assert low <= summary["goodput"] <= high
    assert "replicas" in proc.stderr  # the tqdm bar


@pytest.mark.parametrize("args, message", [
    (["--calibration", "/nonexistent/calibration.json"], "no such calibration file"),
    (["--set", "policy.kind=sometimes"], "policy.kind"),
    (["--set", "regions.9.nodes=3"], "regions.9"),
    (["--replicas", "0"], "--replicas"),
])
def test_bad_input_exits_2_naming_it(args, message, capsys):
    assert main(["simulate", LOCAL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_calibration_content_exits_2(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"primitives": {"restart_s": {"median": "soon"}}}))
    assert main(["simulate", LOCAL, "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "primitives.restart_s.median" in err
