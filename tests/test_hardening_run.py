"""Issue 28: one run per run directory, and a run stopped by a signal as a service is stopped
(SIGTERM, SIGHUP, a Ctrl-C to the process group): every process it started exits, the last
complete checkpoint is named with the command that resumes, no traceback anywhere."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from keel.errors import InputError
from keel.rundir import LOCK, RunDirLock, check_not_in_use
from runtime_helpers import REPO, keel, write_scenario

pytestmark = pytest.mark.timeout(240)


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    check_not_in_use(tmp_path)  # no lock file: nothing said, nothing written
    assert not (tmp_path / LOCK).exists()
    with RunDirLock(tmp_path):
        with pytest.raises(InputError, match=rf"in use by pid {os.getpid()} on "):
            RunDirLock(tmp_path)
        with pytest.raises(InputError, match=rf"--resume {tmp_path}: in use by pid {os.getpid()} on "):
            check_not_in_use(tmp_path / "checkpoints", "--resume")  # keel run's early look, read-only
    check_not_in_use(tmp_path)
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


def _default_signals() -> None:
    """keel, like nohup'd programs, leaves a signal alone that it was started ignoring: a suite
    run under nohup or in a non-interactive shell's background ignores SIGHUP or SIGINT, which a
    child inherits. The job under test starts as from a terminal, with the default dispositions."""
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def _start(scenario: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(keel("run", str(scenario), "--out", str(out), *extra), start_new_session=True,
                            preexec_fn=_default_signals, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(REPO))


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
        if group:  # a Ctrl-C prints one line (beside the run's progress lines, a log's "now and then")
            progress = re.compile(r"^[^:]+: \d+/\d+ ")
            assert len([line for line in err.splitlines() if line.strip() and not progress.match(line)]) == 1, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_changed_model_shape_is_refused_before_the_job_starts(tmp_path):
    """--allow-config-change resumes a changed configuration; a model of another shape is
    found from the checkpoint's tensor shapes before anything starts, and named."""
    from keel.scenario import load
    from runtime.checkpoint import capture_rng, save_checkpoint
    from runtime.model import build_model, build_optimizer
    from runtime.resume_check import first_mismatch
    sc_path = write_scenario(tmp_path, steps=20, interval=5)
    sc = load(sc_path)
    model = build_model(sc.model, 0)
    save_checkpoint(tmp_path / "done" / "checkpoints", step=5, model=model, optimizer=build_optimizer(model, sc.model),
                    rng=capture_rng(), data_state={"format": "keel-loader", "step": 5, "seed": 5, "version": "v" * 64,
                                                   "quarantine": []},
                    config_hash=sc.config_hash(), config=sc.to_dict(), topology={"generation": 0})
    p = subprocess.run(keel("run", str(sc_path), "--out", str(tmp_path / "again"), "--resume", str(tmp_path / "done"),
                            "--allow-config-change", "--set", "model.d_model=48"),
                       capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "step-00000005 does not fit the scenario's model (tensor " in p.stderr and "[256, 32]" in p.stderr
    assert not (tmp_path / "again" / "logs").exists()  # no worker started
    assert first_mismatch({"a": [2], "b": [3]}, {"a": [2], "b": [3]}) is None
    assert first_mismatch({"a": [2]}, {"a": [2], "b": [3]}) == "tensor b [3]: not in the checkpoint"
    assert first_mismatch({"a": [2], "c": [1]}, {"a": [2]}).startswith("tensor c [1]: in the checkpoint")


def test_a_worker_error_says_its_type_and_first_lines():
    from runtime.worker_process import error_text
    try:
        raise RuntimeError("Error(s) in loading state_dict for GPT:\n\tsize mismatch for a\n\tb\n\tc\n\td\n\te")
    except RuntimeError as e:
        text = error_text(e)
    assert text.startswith("RuntimeError: Error(s) in loading state_dict for GPT:\n\tsize mismatch for a")
    assert "\te" not in text and "test_hardening_run.py:" in text
