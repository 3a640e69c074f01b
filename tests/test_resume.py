"""Bit-exact resume (issue 3), also with the resilient runtime absorbing faults (issue 4):
run N steps uninterrupted; in another run SIGKILL every process of the job after a checkpoint
and resume with `--resume`; the losses from the checkpoint on and the final weights match."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from runtime_helpers import REPO, keel, run, run_and_kill_after_checkpoint, write_scenario

pytestmark = pytest.mark.timeout(240)

STEPS, CKPT = 16, 10


def _kill_and_resume(tmp_path, **kw):
    base, _ = run(tmp_path, "uninterrupted", steps=STEPS, **kw)
    path = write_scenario(tmp_path, steps=STEPS, **kw)
    first, second = tmp_path / "killed", tmp_path / "resumed"
    killed_at = run_and_kill_after_checkpoint(keel("run", str(path), "--out", str(first)), first, CKPT)
    assert killed_at >= CKPT - 1
    assert not (first / "summary.json").exists()
    out = subprocess.run(keel("run", str(path), "--out", str(second), "--resume", str(first), "--json"),
                         capture_output=True, text=True, cwd=str(REPO), timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 1  # --json: one object on stdout, nothing else
    resumed = json.loads(lines[0])
    assert resumed["start_step"] == CKPT
    assert resumed["losses"] == base["losses"][CKPT:]
    assert resumed["final_weights_sha256"] == base["final_weights_sha256"]
    assert all(math.isfinite(x) for x in resumed["losses"])
    start = json.loads((second / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "run_start" and start["detail"]["resume_from"].endswith(f"step-{CKPT:08d}")
    return base, resumed


def test_resume_one_worker_bit_exact(tmp_path):
    _kill_and_resume(tmp_path, regions=[("a", 1)], hot_spares=0, slots=2)


def test_resume_four_workers_bit_exact(tmp_path):
    _kill_and_resume(tmp_path, regions=[("a", 2), ("b", 2)], hot_spares=0, slots=4)


def test_resume_with_faults_absorbed_bit_exact(tmp_path):
    # a hardware fault before the checkpoint, another after the resume: both absorbed
    faults = [{"at_step": 3, "class": "hardware_fault", "target": "a/1"},
              {"at_step": 12, "class": "hardware_fault", "target": "b/0"}]
    base, resumed = _kill_and_resume(tmp_path, faults=faults)
    assert base["restarts"] == 0 and resumed["restarts"] == 0
    assert [f["at_step"] for f in resumed["faults"]] == [12]
    clean, _ = run(tmp_path, "clean", steps=STEPS)
    assert resumed["losses"] == clean["losses"][CKPT:]  # and both equal the fault-free run


def test_resume_refuses_a_changed_config(tmp_path):
    path = write_scenario(tmp_path, steps=6, interval=3, regions=[("a", 1)], hot_spares=0, slots=1)
    run(tmp_path, "done", steps=6, interval=3, regions=[("a", 1)], hot_spares=0, slots=1)
    out = subprocess.run(keel("run", str(path), "--out", str(tmp_path / "again"), "--resume", str(tmp_path / "done"),
                              "--set", "model.lr=0.01", "--steps", "8"),
                         capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model.lr" in out.stderr and "--allow-config-change" in out.stderr
