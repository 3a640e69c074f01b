"""A run directory (`keel simulate --out`, `keel run --out`, a validation's sub-runs):
`events.jsonl` and `summary.json`, written and read in one place, and the one way every tool
prints a JSON object on stdout (`--json`)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from keel.errors import InputError

EVENTS = "events.jsonl"
SUMMARY = "summary.json"


def _dumps(obj: Any, indent: int | None) -> str:
    return json.dumps(obj, indent=indent, sort_keys=True, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    """`obj` as indented JSON at `path` (keys sorted, no NaN), replaced atomically: a reader
    never sees half a file. The parent directory is created."""
    path = Path(path)
    text = _dumps(obj, 1) + "\n"  # before any file exists: a value JSON cannot hold leaves none
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
    return path


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    """`out_dir/summary.json`, replaced atomically (a reader never sees half a file)."""
    return write_json(Path(out_dir) / SUMMARY, summary)


def write_run(out_dir: str | Path, events: Iterable[Any], summary: dict[str, Any]) -> Path:
    """A whole run directory from a finished run (the twin's): a fresh events.jsonl, then the
    summary."""
    from keel.events import write_events
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / EVENTS).unlink(missing_ok=True)
    write_events(out / EVENTS, events)
    write_summary(out, summary)
    return out


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / SUMMARY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (expected a run directory with {EVENTS} and {SUMMARY})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def read_events(run_dir: str | Path) -> list[Any]:
    from keel.events import read_events as _read
    return _read(Path(run_dir) / EVENTS)


def is_run_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / EVENTS).is_file() and (p / SUMMARY).is_file()


def print_json(obj: Any) -> None:
    """`--json`: one JSON object on stdout and nothing else there."""
    sys.stdout.write(_dumps(obj, None) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- one run per directory

LOCK = ".keel.lock"


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RunDirLock:
    """An exclusive lock on a run directory (`DIR/.keel.lock`, flock): one run writes a run
    directory at a time. The file names its holder (pid, host, start time, command); the kernel
    drops the lock when the holder exits however it exits, so a lock file whose holder is gone
    is stale: it is taken over, and said so, naming the dead holder. Not inherited by child
    processes (the descriptor is close-on-exec; a fork server is started by exec)."""

    def __init__(self, run_dir: str | Path, flag: str = "--out"):
        import fcntl
        import socket
        import time
        self.path = Path(run_dir) / LOCK
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)  # not held: its file stays as its holder wrote it
            self.fd = None
            raise _in_use(run_dir, flag, holder) from None
        previous = self._holder()
        if previous:
            print(f"keel: {run_dir}: a stale lock of {previous}, which exited without releasing it; taken over",
                  file=sys.stderr, flush=True)
        me = (f"pid {os.getpid()} on {socket.gethostname()} (started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
              f"{' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]})")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, me.encode("utf-8", "replace"), 0)

    def _holder(self) -> str:
        try:
            text = os.pread(self.fd, 4096, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        if not text.startswith("pid "):
            return ""
        return text

    def close(self) -> None:
        """Release the lock (and empty the file: a released lock is not stale)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _in_use(run_dir: str | Path, flag: str, holder: str) -> InputError:
    return InputError(f"{flag} {run_dir}: in use by {holder or 'another process'}; a run directory holds one run "
                      f"at a time (wait for that run, stop it, or choose another directory)")


def check_not_in_use(run_dir: str | Path, flag: str = "--out") -> None:
    """The InputError RunDirLock would raise, found without writing anything (the lock file
    opened read-only, only if it exists): `keel run` asks before the job's imports and checks;
    the supervisor's RunDirLock still takes the lock for the run."""
    import fcntl
    run_dir = Path(run_dir)
    if run_dir.name == "checkpoints" and flag == "--resume":
        run_dir = run_dir.parent
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (or none readable): RunDirLock decides
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        raise _in_use(run_dir, flag, text if text.startswith("pid ") else "") from None
    finally:
        os.close(fd)  # closing drops the flock taken, if any


def lock_run_dirs(out_dir: str | Path, resume: str | Path | None = None) -> list[RunDirLock]:
    """The locks of a run: its directory, and the one it resumes from if that is another
    (a run still writing checkpoints there is not resumed from)."""
    locks = [RunDirLock(out_dir)]
    if resume is not None and Path(resume).resolve() != Path(out_dir).resolve():
        try:
            resume_dir = Path(resume)
            if resume_dir.name == "checkpoints":
                resume_dir = resume_dir.parent
            locks.append(RunDirLock(resume_dir, "--resume"))
        except InputError:
            locks[0].close()
            raise
        except OSError:  # a read-only directory of checkpoints: nothing writes there, nothing to hold
            pass
        except BaseException:
            locks[0].close()
            raise
    return locks
