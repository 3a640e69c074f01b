"""A worker process's own concerns, apart from training: dying with its parent, picking its
device, and the text its failure sends the user."""
from __future__ import annotations

import os
import signal
import traceback

import torch


def set_pdeathsig() -> None:
    """Die with the parent (Linux): a worker spawned by `keel run` never outlives it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def freeze_self(heal_s: float) -> None:
    """A network partition emulated at the process boundary, on a worker no local coordinator
    spawned: a detached waker sends SIGCONT `heal_s` from now, then the process stops itself.
    Until then it sends nothing and resets nothing, as behind a real cut."""
    import subprocess
    subprocess.Popen(["/bin/sh", "-c", f"sleep {max(0.0, heal_s):.3f}; kill -CONT {os.getpid()}"],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)


def error_text(e: BaseException, lines: int = 4) -> str:
    """What a worker's failure tells the user: the exception's type and the first lines of its
    message (a traceback's tail starts mid-sentence), and where it was raised."""
    text = "\n".join(str(e).strip().splitlines()[:lines])[:800]
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}; the traceback is in the worker's log)" if tb else ""
    return f"{type(e).__name__}: {text}{where}"


def pick_device(device: str, backend: str, local_index: int) -> str:
    """The worker's device: "cuda" without an index puts the node on one of this machine's
    GPUs by its index among them (torchrun's LOCAL_RANK where set; with gloo several workers
    may share one GPU); with NCCL each rank must have a GPU of its own."""
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError(f"KEEL_DEVICE={device}: torch sees no CUDA device here")
        if backend == "nccl" or ":" not in device:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', local_index)) % count}"
        torch.cuda.set_device(torch.device(device))
    return device
