"""Deterministic reduction over slots: exact fixed-point summation with a shared exponent.

Every slot contributes one flat float32 vector (its gradients, then its loss). The mean over
slots must not depend on which worker holds which slot, nor on the world size, nor on the
order in which the collective adds the workers' parts. Floating-point addition is not
associative, so a plain float all-reduce fails that; integer addition is associative (exactly,
even with wrap-around), so we add integers:

1. Each worker takes, per segment (one parameter tensor, or the loss), the largest |value|
   over its slots, plus a non-finite flag. One all-reduce MAX of that short vector gives every
   worker the same global maxima M_i, hence the same exponent e_i (M_i < 2^e_i).
2. Each slot's values are scaled by 2^shift_i (shift_i = 61 - e_i - ceil(log2(slots))),
   rounded half to even to int64 and summed over the worker's slots. With that shift no sum
   of `slots` terms can overflow 2^63. The scaling is exact: a power-of-two factor changes only
   the exponent. It runs in float32 when every 2^shift_i is a normal float32 (a product that
   falls below float32's normal range is < 2^-126 and rounds to 0 all the same), else in
   float64; the per-value factors are cached per shift vector.
3. One all-reduce SUM of the int64 vector. Its result is the exact sum of the rounded values,
   whatever the grouping. Decoding (int64 -> float64, x (2^-shift_i / slots), -> float32) is a
   fixed sequence of operations on identical inputs, so every worker gets identical bits.

Accuracy: each value is quantised to M_i x 2^-(60 - log2 slots) or finer, 2^-36 below the
largest value of its tensor times float32's own resolution, so the result equals the float64
mean of the slots rounded to float32, up to one float32 rounding. The plain float32 mean is
itself only that accurate.

A non-finite value anywhere sets the flag instead; every worker sees it after step 1 and the
step is not committed (quarantine, see worker.py). The int64 round is then skipped.

One round in the common case (`SlotReducer.reduce`): given a priori bounds that every worker
knows identically, step 1 is not needed. Each worker encodes with the bounds' shifts and checks
the bounds on the scaled values (|v| < 2^e exactly when |v x 2^shift| < 2^(61 - ceil(log2
slots))), one min/max pass per slot, and appends two counters to the int64 vector: overflow
(a finite value beyond its bound) and non-finite. If any worker overflowed, the step takes the
two rounds above; which path it takes depends only on the bounds and the slots' values.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SHIFT_BASE = 61  # bits of headroom in an int64 sum, minus one for the sign
ZERO_BOUND = -149  # the exponent of a zero bound: 2**-149 is the smallest positive float32, so it admits only 0


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


def _headroom(slots: int) -> int:
    return max(0, math.ceil(math.log2(slots))) if slots > 1 else 0


def shifts_for(exps: Sequence[int], slots: int) -> tuple[int, ...]:
    """The power of two each segment is scaled by, for values below 2**e: their scaled values
    are below 2^(SHIFT_BASE - headroom), so no sum of `slots` of them overflows."""
    return tuple(SHIFT_BASE - e - _headroom(slots) for e in exps)


def shifts(global_maxima: torch.Tensor, slots: int) -> tuple[int, ...]:
    """The power of two each segment is scaled by before rounding."""
    return shifts_for(exponents(global_maxima[:-1].tolist()), slots)


def bound_exponents(bounds: Sequence[float] | None) -> list[int] | None:
    """e with bound < 2**e per a priori bound (ZERO_BOUND for a zero bound); None: no bounds."""
    if bounds is None:
        return None
    return [math.frexp(b)[1] if b > 0 else ZERO_BOUND for b in bounds]


@functools.lru_cache(maxsize=2)
def _scale(layout: Layout, shift: tuple[int, ...]) -> torch.Tensor:
    """2^shift per value (cached: shifts change rarely). float32 when every factor is a normal
    float32: then v x 2^shift is exact in float32 (a product below the normal range is < 2^-126
    and rounds to 0 all the same); float64 otherwise, exact for every float32 v."""
    dtype = torch.float32 if -126 <= min(shift) and max(shift) <= 127 else torch.float64
    return layout.expand(torch.tensor([math.ldexp(1.0, s) for s in shift], dtype=dtype))


@functools.lru_cache(maxsize=2)
def _mult(layout: Layout, shift: tuple[int, ...], slots: int) -> torch.Tensor:
    """float64 2^-shift / slots per value, the decoding factor (cached)."""
    return layout.expand(torch.tensor([math.ldexp(1.0, -s) for s in shift], dtype=torch.float64) / slots)


def _scaled(layout: Layout, v: torch.Tensor, shift: tuple[int, ...]) -> torch.Tensor:
    """round_half_even(v x 2^shift), exact, as integral floats."""
    return (v * _scale(layout, shift)).round_()


def _add(out: torch.Tensor, q: torch.Tensor, first: bool) -> None:
    if first:
        out.copy_(q)  # integral floats: the conversion to int64 is exact
    else:
        out.add_(q.to(torch.int64))


def encode(layout: Layout, slot_vectors: Sequence[torch.Tensor], shift: tuple[int, ...]) -> torch.Tensor:
    """int64[total]: the sum over these slots of round_half_even(value x 2^shift) (exact).
    The values must be finite and below the shift's bound."""
    out = torch.empty(layout.total, dtype=torch.int64)
    if not slot_vectors:
        return out.zero_()
    for i, v in enumerate(slot_vectors):
        _add(out, _scaled(layout, v, shift), i == 0)
    return out


def encode_bounded(layout: Layout, slot_vectors: Sequence[torch.Tensor], shift: tuple[int, ...],
                   slots: int, out: torch.Tensor) -> tuple[int, int]:
    """`encode` with a priori bounds, checked on the scaled values (|v| < 2^e exactly when
    |v x 2^shift| < 2^(SHIFT_BASE - headroom)): returns the counters (overflow, non-finite),
    (1, 0) if some finite value exceeds its bound, (0, 1) if some value is not finite; `out`
    is then all zeros."""
    limit = math.ldexp(1.0, SHIFT_BASE - _headroom(slots))
    over = nonfinite = False
    for i, v in enumerate(slot_vectors):
        q = _scaled(layout, v, shift)
        lo, hi = (float(x) for x in torch.aminmax(q))
        if not (-limit < lo and hi < limit):  # NaN fails too; a float32 product may overflow to inf
            if bool(torch.isfinite(v).all()):
                over = True
            else:
                nonfinite = True
        elif not (over or nonfinite):
            _add(out, q, i == 0)
    if over or nonfinite or not slot_vectors:
        out.zero_()
    return int(over and not nonfinite), int(nonfinite)


def decode(layout: Layout, total: torch.Tensor, shift: tuple[int, ...], slots: int) -> torch.Tensor:
    """float32[total]: the mean over all slots from the all-reduced int64 sum."""
    return total.to(torch.float64).mul_(_mult(layout, shift, slots)).to(torch.float32)


def reduce_local(layout: Layout, per_worker: Sequence[Sequence[torch.Tensor]], slots: int,
                 bounds: Sequence[float] | None = None) -> torch.Tensor | None:
    """The whole reduction without a network, for tests and for checking: `per_worker` is each
    worker's list of slot vectors. None if any value is non-finite."""
    exps = bound_exponents(bounds)
    if exps is not None:
        sh = shifts_for(exps, slots)
        parts = [torch.empty(layout.total, dtype=torch.int64) for _ in per_worker]
        over, nonfinite = map(sum, zip(*(encode_bounded(layout, vs, sh, slots, out)
                                         for vs, out in zip(per_worker, parts))))
        if nonfinite:
            return None
        if not over:
            return decode(layout, sum(parts), sh, slots)
    m = torch.stack([local_maxima(layout, vs) for vs in per_worker]).max(dim=0).values
    if m[-1] > 0:
        return None
    sh = shifts(m, slots)
    total = sum(encode(layout, vs, sh) for vs in per_worker)
    return decode(layout, total, sh, slots)


# ----------------------------------------------------------------------------- on a process group

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


class SlotReducer:
    """The reduction of one step on a process group: one collective when a priori bounds
    hold, else two."""

    def __init__(self, layout: Layout, slots: int, device: str = "cpu", waiter: Waiter | None = None,
                 collective: Callable[[object, torch.Tensor, str, Callable[[], bool]], torch.Tensor] | None = None):
        self.waiter = waiter
        self.collective = collective  # (pg, tensor, "sum" | "max", should_abort) -> tensor; None: gloo's all-reduce
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
        layout, slots = self.layout, self.slots
        exps = bound_exponents(bounds)
        if exps is not None:
            sh = shifts_for(exps, slots)
            buf = torch.empty(layout.total + 2, dtype=torch.int64)
            buf[-2:] = torch.tensor(encode_bounded(layout, slot_vectors, sh, slots, buf[:-2]))
        else:
            m = local_maxima(layout, slot_vectors)
        before_comm()
        self.last_rounds = 1
        if exps is not None:
            buf = self._allreduce(pg, buf, "sum", should_abort)
            over, nonfinite = buf[-2:].tolist()
            if nonfinite:
                return None
            if not over:
                return decode(layout, buf[:-2], sh, slots)
            m = local_maxima(layout, slot_vectors)
        self.last_rounds = 2
        m = self._allreduce(pg, m, "max", should_abort)
        if m[-1] > 0:
            return None
        sh = shifts(m, slots)
        total = self._allreduce(pg, encode(layout, slot_vectors, sh), "sum", should_abort)
        return decode(layout, total, sh, slots)

    def _allreduce(self, pg, t: torch.Tensor, op: str, should_abort: Callable[[], bool]) -> torch.Tensor:
        if self.collective is not None:
            return self.collective(pg, t, op, should_abort)
        import torch.distributed as dist
        t = t if self.device == "cpu" else t.to(self.device)
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        return allreduce(pg, t, reduce_op, should_abort, self.waiter).cpu()
