"""Waiting on a process group while watching for the coordinator's abort: the waiter, the
collectives the runtime posts directly, and work that blocks its thread (run_watched)."""
from __future__ import annotations

import threading
from typing import Callable

import torch


class Aborted(Exception):
    """The coordinator aborted the generation while this worker waited on a collective."""


class CollectiveError(RuntimeError):
    """A collective failed (a peer's connection broke)."""


class Waiter:
    """Waits on async collective work without spinning: the work's future sets an event when it
    completes (a callback, run by the collective's own thread); the abort signal (`interrupt()`,
    called from the control channel's reader thread) sets the same event. So a survivor leaves
    at once when the coordinator aborts, instead of sitting out a gloo timeout, and a waiting
    worker costs no CPU and starts no thread."""

    safety_net_s = 0.05  # the longest wait between checks, should an event be missed

    def __init__(self) -> None:
        self._event: threading.Event | None = None

    def interrupt(self) -> None:
        ev = self._event
        if ev is not None:
            ev.set()

    def wait(self, work, should_abort: Callable[[], bool]) -> None:
        if not work.is_completed():
            ev = threading.Event()
            self._event = ev
            fut = work.get_future()
            fut.add_done_callback(lambda _: ev.set())
            try:
                while not work.is_completed():
                    if should_abort():
                        raise Aborted()
                    # short once the future is done: gloo's completes just before its work, a
                    # CUDA (NCCL) one as soon as it is queued
                    ev.wait(0.0002 if fut.done() else self.safety_net_s)
                    ev.clear()  # completion and abort are re-checked at the top
            finally:
                self._event = None
        try:
            work.wait()
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e


_DEFAULT_WAITER = Waiter()


def run_watched(fn: Callable[[], None], should_abort: Callable[[], bool], name: str = "watched",
                poll_s: float = 0.005) -> None:
    """Run `fn` on a daemon thread of its own and wait for it here, raising `Aborted` as soon as
    `should_abort()` holds (what `fn` raised, otherwise): for work that blocks its thread and
    cannot be interrupted (gloo's lazy connect, a store wait). A thread left behind ends
    with its own timeout."""
    done = threading.Event()
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            error.append(e)
        finally:
            done.set()
    threading.Thread(target=target, daemon=True, name=name).start()
    while not done.wait(poll_s):
        if should_abort():
            raise Aborted()
    if error:
        raise error[0]


def wait_work(work, should_abort: Callable[[], bool], waiter: Waiter | None = None) -> None:
    """Wait on async collective work while watching for the coordinator's abort; raises
    `Aborted`, or `CollectiveError` if the collective failed."""
    (waiter or _DEFAULT_WAITER).wait(work, should_abort)


def allreduce(pg, tensor: torch.Tensor, op, should_abort: Callable[[], bool], waiter: Waiter | None = None) -> torch.Tensor:
    import torch.distributed as dist
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait_work(pg.allreduce([tensor], opts), should_abort, waiter)
    return tensor


def broadcast(pg, tensor: torch.Tensor, root: int, should_abort: Callable[[], bool], waiter: Waiter | None = None) -> torch.Tensor:
    import torch.distributed as dist
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    wait_work(pg.broadcast([tensor], opts), should_abort, waiter)
    return tensor
