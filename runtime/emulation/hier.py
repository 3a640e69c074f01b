"""The hierarchical all-reduce of the emulated cluster, as real point-to-point messages.

The reduction follows the cluster's topology (the twin describes the same one, from the same
scenario, keel.hardware.ring_members): the generation's ranks grouped by region, the regions
in ring order. For a vector of `length` elements:

1. **intra-region reduce-scatter**: each region of n members splits the vector into n
   balanced chunks and runs a ring: at step s member i sends chunk (i - s) mod n to member
   i + 1, which combines it into its own. After n - 1 steps member i owns chunk (i + 1) mod n,
   reduced over its region.
2. **inter-region ring** over the R regions, on a global partition G_0 .. G_{R-1}: a
   reduce-scatter (R - 1 steps, region a sends G_(a - s) mod R to region a + 1), then an
   all-gather (R - 1 steps, region a sends G_(a + 1 - s) mod R, which the next one copies).
   Region a's piece of G_k lives on the owners of step 1, so one message goes from each owner
   in a to each owner in a + 1 whose chunks overlap inside G_k: every owner talks across
   regions, as the bandwidth of a real cluster's NICs is used.
3. **intra-region all-gather**: the ring of step 1 backwards in effect (member i sends chunk
   (i + 1 - s) mod n, copied by the next).

Steps of all regions that run at the same time share one `Step` (their messages are priced
together: netem.py's bandwidth sharing sees every concurrent transfer). Empty messages and
steps are left out; one member alone has an empty plan.

Exactness: the sum runs on int64 (the fixed-point encoding of reduction.py), whose addition is
associative even with wrap-around, and max is exact, so every rank ends with the same bits as
any other all-reduce of the same vectors (`simulate` is the reference).

Time: every message carries, in an 8-byte float64 header, its emulated arrival, computed by
the sender from its own clock at the start of the step (`price(step, msg, t_send)`); a rank's
clock after a step is the latest arrival it received. `clocks` is the same account without a
network, for tests.
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from keel.collective import Msg, Step, _chunks, build_plan, plan_for  # noqa: F401 (the plan is keel's)
from runtime.waiting import CollectiveError, wait_work

HEADER = 8  # bytes: the float64 arrival time in front of every payload


def _combine(dst: torch.Tensor, payload: torch.Tensor, combine: str, op: str) -> None:
    if combine == "copy":
        dst.copy_(payload)
    elif op == "sum":
        dst.add_(payload)
    else:
        torch.maximum(dst, payload, out=dst)


def simulate(plan: Sequence[Step], vectors: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    """The plan without a network: every rank's vector after it (the reference)."""
    out = [v.clone() for v in vectors]
    for step in plan:
        payloads = [out[m.src][m.offset:m.offset + m.length].clone() for m in step.msgs]
        for m, p in zip(step.msgs, payloads):
            _combine(out[m.dst][m.offset:m.offset + m.length], p, step.combine, op)
    return out


Price = Callable[[Step, Msg, float], float]  # (step, message, send time) -> arrival time


def clocks(plan: Sequence[Step], start: Sequence[float], price: Price) -> list[float]:
    """Every rank's emulated clock after the plan, from its clock before (`start`)."""
    c = list(start)
    for step in plan:
        sent = list(c)
        for m in step.msgs:
            c[m.dst] = max(c[m.dst], price(step, m, sent[m.src]))
    return c


class _Blocking:
    """gloo's point-to-point work has no future and never reports itself completed, and a
    wait with a timeout breaks its pair: so each step's works are waited on by a daemon
    thread (a small pool, grown on demand), whose Future the abort-aware Waiter watches. A
    wait left behind by an abort ends when the old group's connection closes or times out."""

    def __init__(self, fut: Future):
        self._fut = fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> Future:
        return self._fut

    def wait(self) -> None:
        self._fut.result()


class _WaitThreads:
    def __init__(self) -> None:
        self._pid = os.getpid()
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, works: list) -> _Blocking:
        fut: Future = Future()
        with self._lock:
            if self._pid != os.getpid():  # a forked child inherits no threads
                self._pid, self._idle = os.getpid(), []
            q = self._idle.pop() if self._idle else None
        if q is None:
            q = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(q,), daemon=True, name="p2p-wait").start()
        q.put((works, fut))
        return _Blocking(fut)

    def _loop(self, q: queue.SimpleQueue) -> None:
        while True:
            works, fut = q.get()
            error = None
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                error = e
            with self._lock:
                self._idle.append(q)
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


_WAITS = _WaitThreads()


def run_plan(pg, rank: int, plan: Sequence[Step], buf: torch.Tensor, op: str, clock: float,
             price: Price, should_abort: Callable[[], bool], waiter=None, tag_base: int = 0) -> float:
    """Run this rank's part of `plan` on `buf` (in place; int64 for "sum", float for "max")
    over the process group `pg`; returns the rank's emulated clock after it. Every step posts
    its receives and sends at once and waits for all of them (raising reduction.Aborted when
    the coordinator aborts the generation meanwhile, reduction.CollectiveError when a peer's
    connection is gone)."""
    try:
        return _run_plan(pg, rank, plan, buf, op, clock, price, should_abort, waiter, tag_base)
    except RuntimeError as e:  # posting a message on a broken pair raises at once
        raise CollectiveError(str(e)) from e


def _run_plan(pg, rank, plan, buf, op, clock, price, should_abort, waiter, tag_base) -> float:
    size = buf.element_size()
    for step in plan:
        recvs, works = [], []
        for m in step.msgs:
            if m.dst == rank:
                t = torch.empty(HEADER + m.length * size, dtype=torch.uint8)
                recvs.append((m, t))
                works.append(pg.recv([t], m.src, tag_base + step.index))
        t_send = clock
        for m in step.msgs:
            if m.src == rank:
                t = torch.empty(HEADER + m.length * size, dtype=torch.uint8)
                t[:HEADER] = torch.tensor([price(step, m, t_send)], dtype=torch.float64).view(torch.uint8)
                t[HEADER:] = buf[m.offset:m.offset + m.length].contiguous().view(torch.uint8)
                works.append(pg.send([t], m.dst, tag_base + step.index))
        if works:
            wait_work(_WAITS.submit(works), should_abort, waiter)
        for m, t in recvs:
            clock = max(clock, float(t[:HEADER].view(torch.float64)[0]))
            _combine(buf[m.offset:m.offset + m.length], t[HEADER:].view(buf.dtype), step.combine, op)
    return clock
