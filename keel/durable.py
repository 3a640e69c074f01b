"""Writing files so that they survive a crash: data fsynced, directory entries fsynced; and
reading a file that may be hostile without following it anywhere (`read_regular`)."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from keel.errors import InputError

PROBE_BYTES = 64 * 1024


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning. An OSError names `path` (a full
    disk's ENOSPC from write or fsync carries no file name of its own)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes; OSError otherwise
    (FileNotFoundError if missing; ELOOP, EINVAL, EFBIG with a strerror that says why). A
    symbolic link is not followed (it could lead out of a checkpoint), a FIFO or device is not
    read (it could block or never end), and no more than `limit` + 1 bytes are read (one more:
    a file that grew is noticed). Both checkpoint readers use it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "a symbolic link; the format's files are regular files") from None
        raise
    except ValueError:  # a NUL in the name
        raise OSError(errno.EINVAL, "not a file name") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} expected (altered or appended to)")
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_dir_path(path: str | Path, flag: str = "--out") -> None:
    """What can be known of a directory to write without writing anything: a file where it
    should be, or where one of its parents should be (an `InputError` as check_writable_dir's).
    `keel run` asks it before the job's contract check, which imports torch and builds the
    model: a bad --out is refused in a fraction of a second."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: exists and is not a directory; expected a directory to write the run into ({flag})")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{path}: cannot create the directory ({parent} is not a directory); "
                                 f"expected a writable directory ({flag})")
            return


def check_writable_dir(path: str | Path, flag: str = "--out") -> Path:
    """Create `path` (and its parents) if missing and prove it writable before any work starts:
    a probe file of PROBE_BYTES written, fsynced and removed. An `InputError` that names the
    directory and what was expected otherwise (a file in the way, a read-only or full file
    system, no permission). What cannot be known here (the disk filling up later) a
    checkpoint write reports when it fails, and the previous checkpoint stays the newest."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: exists and is not a directory; expected a directory to write the run into ({flag})")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{path}: cannot create the directory ({e.strerror}); expected a writable directory ({flag})") from None
    probe = path / f".keel-write-probe-{os.getpid()}"
    try:
        write_synced(probe, b"\0" * PROBE_BYTES)
    except OSError as e:
        raise InputError(f"{path}: cannot write there ({e.strerror}); expected a writable directory with "
                         f"free space ({flag})") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path


def check_resume_dir(resume: str | Path) -> Path:
    """`--resume DIR` names a directory (checked before any work starts)."""
    resume = Path(resume)
    if not resume.is_dir():
        what = "not a directory" if resume.exists() else "no such directory"
        raise InputError(f"--resume {resume}: {what}; expected a run directory (or its checkpoints/) to resume from")
    return resume
