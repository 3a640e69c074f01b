"""Launching: workers started by torchrun join a coordinator by address; a run that cannot
absorb its fault fails with RunFailed (exit 1 from the CLI)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from keel.errors import RunFailed
from runtime_helpers import REPO, run, scenario

pytestmark = pytest.mark.timeout(180)


def test_torchrun_workers_join_a_running_coordinator(tmp_path, monkeypatch):
    from runtime.supervisor import Supervisor
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this interpreter")
    sc = scenario(steps=6, regions=[("a", 1), ("b", 1)], hot_spares=0, slots=2)
    monkeypatch.setenv("KEEL_JOB_SECRET", "the-test-job")
    sup = Supervisor(sc, tmp_path / "run", spawn=False, options={"progress": False, "hangs": ""})
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(summary=sup.run()), daemon=True)
    t.start()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", KEEL_JOB_SECRET="the-test-job")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "runtime.worker",
                           "--coordinator", f"127.0.0.1:{sup.port}"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=150)
    t.join(60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = result["summary"]
    assert summary["steps"] == 6 and summary["restarts"] == 0
    # RANK i took the i-th scenario node; the run equals the one keel run spawns itself
    assert all(len(p) == 1 for p in summary["pids"].values())
    spawned, _ = run(tmp_path, "spawned", steps=6, regions=[("a", 1), ("b", 1)], hot_spares=0, slots=2)
    assert summary["losses"] == spawned["losses"]


def test_unabsorbable_fault_fails_the_run(tmp_path):
    with pytest.raises(RunFailed, match="policy.quarantine is false"):
        run(tmp_path, "noq", steps=8, regions=[("a", 1)], hot_spares=0, slots=2,
            faults=[{"at_step": 2, "class": "data_shard_skew", "target": "shard/1"}], quarantine=False)


def test_cli_exit_codes(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "keel.cli", "run", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert bad.returncode == 2 and "missing.toml" in bad.stderr


def test_a_run_whose_workers_all_die_before_joining_fails_at_once(tmp_path):
    """Every worker process dies as it starts (here: KEEL_DEVICE=cuda where torch sees no
    GPU): the run fails at once, pointing at the workers' output, instead of waiting out the
    join timeout (it waited 8 minutes on a GPU machine, 4 Dec, before _pick_device was fixed)."""
    import time
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: KEEL_DEVICE=cuda would work")
    from runtime_helpers import write_scenario
    path = write_scenario(tmp_path, steps=4)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "keel.cli", "run", str(path), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=str(REPO), timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO), KEEL_DEVICE="cuda"))
    assert p.returncode == 1, p.stderr[-2000:]
    assert "every worker process exited before joining" in p.stderr and str(tmp_path / "run" / "logs") in p.stderr
    assert time.monotonic() - t0 < 60
    logs = "".join(f.read_text() for f in (tmp_path / "run" / "logs").glob("*.log"))
    assert "torch sees no CUDA device" in logs
