"""Deterministic reduction over slots: exact fixed-point summation with a shared exponent.

Every slot contributes one flat float32 vector (its gradients, then its loss). The mean over
slots must not depend on which worker holds which slot, nor on the world size, nor on the
order in which the collective adds the workers' parts. Floating-point addition is not
associative, so a plain float all-reduce fails that; integer addition is associative (exactly,
even with wrap-around), so we add integers:

1. Each worker takes, per segment (one parameter tensor, or the loss), the largest |value|
   over its slots, plus a non-finite flag. One all-reduce MAX of that short vector gives every
   worker the same global maxima M_i, hence the same exponent e_i (M_i < 2^e_i).
2. Each slot's values are scaled by 2^shift_i (shift_i = 61 - e_i - ceil(log2(slots))) in
   float64 (exact: float32 -> float64 and a power-of-two scale lose nothing), rounded half to
   even to int64 and summed over the worker's slots. With that shift no sum of `slots` terms
   can overflow 2^63.
3. One all-reduce SUM of the int64 vector. Its result is the exact sum of the rounded values,
   whatever the grouping. Decoding (int64 -> float64, x (2^-shift_i / slots), -> float32) is a
   fixed sequence of operations on identical inputs, so every worker gets identical bits.

Accuracy: each value is quantised to M_i x 2^-(60 - log2 slots) or finer, 2^-36 below the
largest value of its tensor times float32's own resolution, so the result equals the float64
mean of the slots rounded to float32, up to one float32 rounding. The plain float32 mean is
itself only that accurate.

A non-finite value anywhere sets the flag instead; every worker sees it after step 1 and the
step is not committed (quarantine, see worker.py). The int64 round is then skipped.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SHIFT_BASE = 61  # bits of headroom in an int64 sum, minus one for the sign


class Aborted(Exception):
    """The coordinator aborted the generation while this worker waited on a collective."""


class CollectiveError(RuntimeError):
    """A collective failed (a peer's connection broke)."""


@dataclass(frozen=True)
class Layout:
    """Where each segment (parameter tensor or loss) lives in a slot's flat vector."""
    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def segments(self) -> int:
        return len(self.sizes)

    @functools.cached_property
    def sizes_t(self) -> torch.Tensor:
        return torch.tensor(self.sizes, dtype=torch.int64)

    @functools.cached_property
    def seg_ids(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.segments), self.sizes_t)

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(per_segment, self.sizes_t)


def local_maxima(layout: Layout, slot_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32[segments + 1]: max |value| per segment over these slots, then the non-finite
    flag (1.0 if any value is NaN or infinite; such segments count 0 in the maxima)."""
    m = torch.zeros(layout.segments, dtype=torch.float32)
    for v in slot_vectors:
        m.scatter_reduce_(0, layout.seg_ids, v.abs(), reduce="amax", include_self=True)  # NaN propagates
    finite = torch.isfinite(m)
    flag = torch.zeros(1) if bool(finite.all()) else torch.ones(1)
    return torch.cat([torch.where(finite, m, torch.zeros(())), flag])


def exponents(maxima: Sequence[float]) -> list[int]:
    """e with m < 2**e for each m (0 for m == 0)."""
    return [math.frexp(m)[1] if m > 0 else 0 for m in maxima]


def shifts_for(exps: Sequence[int | None], slots: int) -> torch.Tensor:
    """int64[segments]: the power of two each segment is scaled by, for values below 2**e
    (None: a zero bound, only zeros, any shift)."""
    headroom = max(0, math.ceil(math.log2(slots))) if slots > 1 else 0
    return torch.tensor([SHIFT_BASE - (e or 0) - headroom for e in exps], dtype=torch.int64)


def shifts(global_maxima: torch.Tensor, slots: int) -> torch.Tensor:
    """int64[segments]: the power of two each segment is scaled by before rounding."""
    return shifts_for(exponents(global_maxima[:-1].tolist()), slots)


def fits(local: torch.Tensor, exps: Sequence[int | None]) -> bool:
    """Every segment's local maximum is below its bound 2**e (a zero bound admits only 0)."""
    return all(m == 0 if e is None else m < math.ldexp(1.0, e) for m, e in zip(local[:-1].tolist(), exps))


def bound_exponents(bounds: Sequence[float] | None) -> list[int | None] | None:
    """e with bound <= 2**e per a priori bound (None for a zero bound); None: no bounds."""
    if bounds is None:
        return None
    return [math.frexp(b)[1] if b > 0 else None for b in bounds]


def encode(layout: Layout, slot_vectors: Sequence[torch.Tensor], shift: torch.Tensor) -> torch.Tensor:
    """int64[total]: the sum over these slots of round_half_even(value x 2^shift) (exact)."""
    scale = layout.expand(torch.exp2(shift.to(torch.float64)))  # powers of two: exact
    acc = None
    for v in slot_vectors:
        q = torch.round(v.to(torch.float64).mul_(scale)).to(torch.int64)
        acc = q if acc is None else acc.add_(q)
    return acc if acc is not None else torch.zeros(layout.total, dtype=torch.int64)


def decode(layout: Layout, total: torch.Tensor, shift: torch.Tensor, slots: int) -> torch.Tensor:
    """float32[total]: the mean over all slots from the all-reduced int64 sum."""
    mult = layout.expand(torch.exp2(-shift.to(torch.float64)) / slots)
    return total.to(torch.float64).mul_(mult).to(torch.float32)


def reduce_local(layout: Layout, per_worker: Sequence[Sequence[torch.Tensor]], slots: int,
                 bounds: Sequence[float] | None = None) -> torch.Tensor | None:
    """The whole reduction without a network, for tests and for checking: `per_worker` is each
    worker's list of slot vectors. None if any value is non-finite."""
    exps = bound_exponents(bounds)
    if exps is not None:
        local = [local_maxima(layout, vs) for vs in per_worker]
        if any(lm[-1] > 0 for lm in local):
            return None
        if all(fits(lm, exps) for lm in local):
            sh = shifts_for(exps, slots)
            return decode(layout, sum(encode(layout, vs, sh) for vs in per_worker), sh, slots)
    m = torch.stack([local_maxima(layout, vs) for vs in per_worker]).max(dim=0).values
    if m[-1] > 0:
        return None
    sh = shifts(m, slots)
    total = sum(encode(layout, vs, sh) for vs in per_worker)
    return decode(layout, total, sh, slots)


# ----------------------------------------------------------------------------- on a process group

class Waiter:
    """Waits on async collective work without spinning: a helper thread blocks in
    `work.wait()` (the GIL released) and sets an event; the abort signal (`interrupt()`, called
    from the control channel's reader thread) sets the same event. So a survivor leaves at once
    when the coordinator aborts, instead of sitting out a gloo timeout, and a waiting worker
    costs no CPU. A helper blocked on an aborted collective ends when that collective fails."""

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

            def block() -> None:
                try:
                    work.wait()
                except Exception:  # noqa: BLE001  (re-raised below by the caller's wait)
                    pass
                ev.set()
            threading.Thread(target=block, daemon=True, name="collective-wait").start()
            try:
                while not work.is_completed():
                    if should_abort():
                        raise Aborted()
                    ev.wait(0.05)  # the timeout is only a safety net
                    ev.clear()  # completion and abort are re-checked at the top
            finally:
                self._event = None
        try:
            work.wait()
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e


_POLLING = Waiter()


def wait_work(work, should_abort: Callable[[], bool], waiter: Waiter | None = None) -> None:
    """Wait on async collective work while watching for the coordinator's abort; raises
    `Aborted`, or `CollectiveError` if the collective failed."""
    (waiter or _POLLING).wait(work, should_abort)


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


class SlotReducer:
    """The reduction of one step on a process group: one collective when a priori bounds
    hold, else two."""

    def __init__(self, layout: Layout, slots: int, device: str = "cpu", waiter: Waiter | None = None):
        self.waiter = waiter
        self.layout = layout
        self.slots = slots
        self.device = device

    def reduce(self, pg, slot_vectors: Sequence[torch.Tensor], should_abort: Callable[[], bool],
               before_comm: Callable[[], None] = lambda: None,
               bounds: Sequence[float] | None = None) -> torch.Tensor | None:
        """The mean over all slots of the run (float32[total]), or None when some slot anywhere
        holds a non-finite value. `before_comm` runs before the first collective (the place
        where injected network delay lives).

        `bounds` (per segment, the same on every worker: a function of the replicated training
        state) turns the common case into one round: every worker encodes with the bounds'
        shift and adds two counters to the int64 vector (workers whose values exceed a bound,
        workers holding a non-finite value). If no one overflowed, that sum is the result; if
        someone did, the step falls back to the two rounds. Which path a step takes depends
        only on the state and the slots' values, so it is the same in every replay."""
        import torch.distributed as dist
        m = local_maxima(self.layout, slot_vectors)
        before_comm()
        self.last_rounds = 2
        exps = bound_exponents(bounds)
        if exps is not None:
            nonfinite = bool(m[-1] > 0)
            ok = not nonfinite and fits(m, exps)
            sh = shifts_for(exps, self.slots)
            data = encode(self.layout, slot_vectors, sh) if ok else torch.zeros(self.layout.total, dtype=torch.int64)
            buf = self._to_dev(torch.cat([data, torch.tensor([0 if ok or nonfinite else 1, int(nonfinite)])]))
            allreduce(pg, buf, dist.ReduceOp.SUM, should_abort, self.waiter)
            buf = buf.cpu()
            if buf[-1] > 0:
                return None
            if buf[-2] == 0:
                self.last_rounds = 1
                return decode(self.layout, buf[:-2], sh, self.slots)
        m = self._to_dev(m)
        allreduce(pg, m, dist.ReduceOp.MAX, should_abort, self.waiter)
        m = m.cpu()
        if m[-1] > 0:
            return None
        sh = shifts(m, self.slots)
        total = self._to_dev(encode(self.layout, slot_vectors, sh))
        allreduce(pg, total, dist.ReduceOp.SUM, should_abort, self.waiter)
        return decode(self.layout, total.cpu(), sh, self.slots)

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device == "cpu" else t.to(self.device)
