"""Issue 28: one run per run directory, and a run stopped by a signal as a service is stopped
(SIGTERM, SIGHUP, a Ctrl-C to the process group): every process it started exits, the last
complete checkpoint is named with the command that resumes, no traceback anywhere."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from keel.errors import InputError
from keel.rundir import LOCK, RunDirLock
from runtime_helpers import REPO, keel, write_scenario

pytestmark = pytest.mark.timeout(240)


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(InputError, match=rf"in use by pid {os.getpid()} on "):
            RunDirLock(tmp_path)
    with RunDirLock(tmp_path):  # released: free again, and not stale
        pass
    assert (tmp_path / LOCK).read_text() == ""


def test_a_stale_lock_of_a_dead_process_is_named_and_taken_over(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK).write_text(f"pid {dead.pid} on somehost (started 2026-12-05 10:00:00: keel run x)")
    with RunDirLock(tmp_path):
        assert f"pid {os.getpid()} " in (tmp_path / LOCK).read_text()
    err = capsys.readouterr().err
    assert f"a stale lock of pid {dead.pid} on somehost" in err and "taken over" in err


def _session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (a `keel run` started in a session of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _start(scenario: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(keel("run", str(scenario), "--out", str(out), *extra), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        ev = out / "events.jsonl"
        if ev.exists() and any(json.loads(line).get("kind") == "checkpoint_end"
                               for line in ev.read_text().splitlines()[:-1]):
            return
        time.sleep(0.05)
    raise AssertionError("no checkpoint within the timeout")


def _stopped(proc: subprocess.Popen, out: Path, sig: int, *, group: bool = False) -> str:
    """Signal the run (its process group, as a terminal's Ctrl-C does, if `group`); its stderr
    once it and every process it started have exited."""
    (os.killpg if group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    deadline = time.monotonic() + 15
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_pids(proc.pid) == [], "processes of the job outlived it"
    assert "Traceback" not in err, err
    for log in (out / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"keel: stopped by {signal.Signals(sig).name}; the last complete checkpoint is {out}"), err
    assert last.endswith(f"--resume {out}"), last
    return err


def test_second_run_on_a_directory_is_refused_and_sigterm_stops_the_first(tmp_path):
    sc = write_scenario(tmp_path, steps=100000, interval=5)
    out = tmp_path / "run"
    first = _start(sc, out)
    try:
        _wait_for_checkpoint(first, out)
        for extra in ((), ("--resume", str(out))):  # a second run there, or one resuming from it
            second = subprocess.run(keel("run", str(sc), "--out", str(out if not extra else tmp_path / "other"),
                                         *extra), capture_output=True, text=True, cwd=str(REPO), timeout=60)
            assert second.returncode == 2, second.stderr
            assert second.stderr.count("\n") == 1 and f"in use by pid {first.pid} " in second.stderr, second.stderr
        run_starts = [line for line in (out / "events.jsonl").read_text().splitlines() if '"run_start"' in line]
        assert len(run_starts) == 1
        _stopped(first, out, signal.SIGTERM)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert (out / LOCK).read_text() == ""  # released


@pytest.mark.parametrize("sig,group", [(signal.SIGHUP, False), (signal.SIGINT, True)], ids=["sighup", "ctrl-c"])
def test_sighup_and_a_ctrl_c_to_the_group_stop_the_job_cleanly(tmp_path, sig, group):
    sc = write_scenario(tmp_path, steps=100000, interval=5)
    out = tmp_path / "run"
    proc = _start(sc, out)
    try:
        _wait_for_checkpoint(proc, out)
        err = _stopped(proc, out, sig, group=group)
        if group:  # a Ctrl-C prints one line
            assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
