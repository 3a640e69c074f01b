"""Process management: the worker processes started on this machine (by the supervisor,
runtime/supervisor.py, which outlives any one coordinator), and a coordinator's handle on them.

A worker is forked from a fork server that imported torch once (fast: what absorb pays to
replace nothing, and what a hot spare already is), or started as a fresh interpreter that
imports everything again (what a torchrun relaunch pays: the checkpoint_restart baseline).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from keel.paths import REPO_ROOT
from runtime.inject import signal_pid
from runtime.protocol import SECRET_ENV

_FORKSERVER = None


def _forkserver():
    """A multiprocessing fork server that has imported the worker (and torch) once."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["runtime.preload"])
        _FORKSERVER = ctx
    return _FORKSERVER


def preload_job(entry: str, job_dir: str | None) -> None:
    """Have the fork server, when it starts, import the job's libraries (runtime/preload.py),
    so a worker forked from it, a replacement included, does not import them again. A fork
    server already running keeps what it has (its workers import the rest themselves)."""
    if _FORKSERVER is None:
        os.environ["KEEL_PRELOAD_JOB"] = f"{job_dir or ''}|{entry}"


def forked_worker(address: str, node: str, log_path: str, secret: str) -> None:
    os.environ[SECRET_ENV] = secret  # this process's own environment: no command line shows it
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from runtime import worker
    os._exit(worker.main(["--coordinator", address, "--node", node, "--die-with-parent"]) or 0)


class LocalProcess:
    """A worker process the supervisor started: a Popen or a multiprocessing Process."""

    def __init__(self, handle):
        self.handle = handle
        if not isinstance(handle, subprocess.Popen):
            # the worker needs nothing from __main__: keep multiprocessing from re-importing the
            # caller's main module in it (a script, pytest, or stdin, which cannot be)
            main = sys.modules["__main__"]
            saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
            try:
                handle.start()
            finally:
                main.__dict__.pop("__spec__", None)
                main.__dict__.update(saved)
        self.pid = handle.pid

    def poll(self) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.wait(timeout)
        self.handle.join(timeout)
        if self.handle.exitcode is None:
            raise subprocess.TimeoutExpired("worker", timeout)
        return self.handle.exitcode

    def signal(self, sig: int) -> bool:
        return signal_pid(self.pid, sig)


class SupervisedProcess:
    """A coordinator's handle on a worker its supervisor started (for it or for a
    predecessor): signalled by pid, its exit told over the link (link.SupervisorLink.exits)."""

    def __init__(self, link, pid: int):
        self.link = link
        self.pid = pid

    def poll(self) -> int | None:
        return self.link.exits.get(self.pid)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.link.wait(lambda: self.pid in self.link.exits, 3600.0 if timeout is None else timeout):
            raise subprocess.TimeoutExpired("worker", timeout)
        return self.link.exits[self.pid]

    def signal(self, sig: int) -> bool:
        if self.pid in self.link.exits:  # gone: the pid may be another process's by now
            return False
        return signal_pid(self.pid, sig)

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for it to exit, then SIGKILL it."""
        if self.pid in self.link.exits:
            return
        try:
            self.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            try:
                self.wait(10)
            except subprocess.TimeoutExpired:
                pass


def start_worker(node: str, address: str, log_path: Path, secret: str,
                 fresh_interpreter: bool = False) -> LocalProcess:
    """Start the worker of `node`, joining the coordinator at `address` with the job's `secret`
    (in its environment, never on its command line), its output in `log_path`."""
    if not fresh_interpreter:
        return LocalProcess(_forkserver().Process(target=forked_worker, args=(address, node, str(log_path), secret),
                                                  name=f"keel-worker-{node}"))
    env = dict(os.environ)
    env[SECRET_ENV] = secret
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "runtime.worker", "--coordinator", address, "--node", node, "--die-with-parent"]
    with open(log_path, "ab") as log:
        return LocalProcess(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                             cwd=str(REPO_ROOT)))
