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

Formats (keel/wire.py holds the bytes rule): `int64` as above, one exponent per tensor; `block32`
and `block16`, the same arithmetic in int32 and int16 with one exponent per block of 32 elements
of a tensor (`blocked`), so a block's resolution follows its own largest value. Their step 1
sends one byte per block (`exponent_codes`: the MAX of the codes is the code of the MAX), so a
step sends 4 (2) bytes per element plus 1/32 byte, agreed from the blocks' true maxima: no a
priori bound, no fallback, always the same two rounds. Every property above holds for every
format. Values are quantised to 2^-(base - ceil(log2 slots)) of their block's bound (base 61,
30, 14); docs/reduction.md states the error bound and the measured accuracy.

A non-finite value anywhere sets the flag instead; every worker sees it after step 1 and the
step is not committed (quarantine, see worker.py). The int64 round is then skipped.

The int64 format takes one round in the common case (`SlotReducer.reduce`): given a priori
bounds that every worker knows identically, step 1 is not needed. Each worker encodes with the bounds' shifts and checks
the bounds on the scaled values (|v| < 2^e exactly when |v x 2^shift| < 2^(61 - ceil(log2
slots))), one min/max pass per slot, and appends two counters to the int64 vector: overflow
(a finite value beyond its bound) and non-finite. If any worker overflowed, the step takes the
two rounds above; which path it takes depends only on the bounds and the slots' values.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from runtime.waiting import Waiter, allreduce

SHIFT_BASE = 61  # bits of headroom in an int64 sum, minus one for the sign
# format -> (integer dtype, its SHIFT_BASE, elements per exponent: None for one per tensor)
FORMATS = {"int64": (torch.int64, SHIFT_BASE, None), "block32": (torch.int32, 30, 32),
           "block16": (torch.int16, 14, 32)}
ZERO_BOUND = -149  # the exponent of a zero bound: 2**-149 is the smallest positive float32, so it admits only 0


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


def reduction_format(scenario) -> str:
    """The format a scenario's run reduces in (keel.wire.effective_format); the twin's `native`
    (a plain all-reduce, not exact) is refused at the runtime's start (runtime/cli.py)."""
    from keel import wire
    return wire.effective_format(scenario.reduction.format, scenario.slot_count)


@functools.lru_cache(maxsize=8)
def blocked(layout: Layout, block: int | None) -> Layout:
    """`layout` with every segment cut into blocks of `block` elements (the last one of a
    segment shorter): each block gets its own exponent. None: `layout` itself."""
    if block is None:
        return layout
    return Layout(tuple(b for n in layout.sizes for b in [block] * (n // block) + ([n % block] if n % block else [])))


def segment_bounds(layout: Layout, element_bounds: torch.Tensor) -> list[float]:
    """Per segment of `layout`, the largest of its elements' a priori bounds."""
    m = torch.zeros(layout.segments, dtype=element_bounds.dtype)
    m.scatter_reduce_(0, layout.seg_ids, element_bounds, reduce="amax", include_self=True)
    return m.tolist()


BOUND_HEADROOM = 256.0  # slot values may exceed the first moment this much and still take one round
LOSS_BOUND = 2.0 ** 20


def moment_bounds(first_moments: Sequence[torch.Tensor]) -> torch.Tensor:
    """A priori bounds per element of a slot's vector from AdamW's first moments (replicated:
    identical on every worker): BOUND_HEADROOM x |moment|, then LOSS_BOUND for the loss. The
    int64 format takes each tensor's largest; the block formats agree exponents instead."""
    parts = [m.detach().abs().flatten().float().cpu() for m in first_moments]
    return torch.cat(parts + [torch.tensor([LOSS_BOUND / BOUND_HEADROOM])]) * BOUND_HEADROOM


EXP_OFFSET = 121  # a block's exponent e travels as the byte e + EXP_OFFSET (e clamped to [-120, 128])
ZERO_CODE, NONFINITE_CODE = 0, 255  # an all-zero block; the non-finite flag (the last byte)


def exponent_codes(maxima: torch.Tensor) -> torch.Tensor:
    """uint8[segments + 1]: per segment the byte of e with max < 2**e (ZERO_CODE for 0; e is
    raised to -120 at least, still a bound), then NONFINITE_CODE if the flag is set. The MAX of
    codes is the code of the MAX of the maxima, so one byte per block agrees the exponents."""
    m = maxima[:-1]
    e = torch.frexp(m).exponent.clamp(-120, 128) + EXP_OFFSET
    codes = torch.where(m > 0, e, torch.full_like(e, ZERO_CODE)).to(torch.uint8)
    return torch.cat([codes, torch.tensor([NONFINITE_CODE if maxima[-1] > 0 else 0], dtype=torch.uint8)])


def code_exponents(codes: torch.Tensor) -> list[int]:
    """The agreed exponent per segment from the all-reduced codes (0 for an all-zero block, as
    `exponents` gives)."""
    c = codes[:-1].to(torch.int32)
    return torch.where(c == ZERO_CODE, 0, c - EXP_OFFSET).tolist()


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


def shifts_for(exps: Sequence[int], slots: int, base: int = SHIFT_BASE) -> tuple[int, ...]:
    """The power of two each segment is scaled by, for values below 2**e: their scaled values
    are below 2^(base - headroom), so no sum of `slots` of them overflows."""
    h = _headroom(slots)
    return tuple(base - e - h for e in exps)


def shifts(global_maxima: torch.Tensor, slots: int, base: int = SHIFT_BASE) -> tuple[int, ...]:
    """The power of two each segment is scaled by before rounding."""
    return shifts_for(exponents(global_maxima[:-1].tolist()), slots, base)


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
        out.copy_(q)  # integral floats within the format's range: the conversion is exact
    else:
        out.add_(q.to(out.dtype))


def encode(layout: Layout, slot_vectors: Sequence[torch.Tensor], shift: tuple[int, ...],
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """int[total]: the sum over these slots of round_half_even(value x 2^shift) (exact).
    The values must be finite and below the shift's bound."""
    out = torch.empty(layout.total, dtype=dtype)
    if not slot_vectors:
        return out.zero_()
    for i, v in enumerate(slot_vectors):
        _add(out, _scaled(layout, v, shift), i == 0)
    return out


def encode_bounded(layout: Layout, slot_vectors: Sequence[torch.Tensor], shift: tuple[int, ...],
                   slots: int, out: torch.Tensor, base: int = SHIFT_BASE) -> tuple[int, int]:
    """`encode` with a priori bounds, checked on the scaled values (|v| < 2^e exactly when
    |v x 2^shift| < 2^(base - headroom)): returns the counters (overflow, non-finite),
    (1, 0) if some finite value exceeds its bound, (0, 1) if some value is not finite; `out`
    is then all zeros."""
    limit = math.ldexp(1.0, base - _headroom(slots))
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
                 bounds: Sequence[float] | None = None, fmt: str = "int64",
                 rounds: list[int] | None = None) -> torch.Tensor | None:
    """The whole reduction without a network, for tests and for checking: `per_worker` is each
    worker's list of slot vectors, `bounds` one per segment of `blocked(layout, fmt's block)`.
    None if any value is non-finite. `rounds`, if given, gets the rounds the step took."""
    dtype, base, block = FORMATS[fmt]
    layout = blocked(layout, block)
    exps = bound_exponents(bounds) if block is None else None  # block formats: exponents first
    if exps is not None:
        sh = shifts_for(exps, slots, base)
        parts = [torch.empty(layout.total, dtype=dtype) for _ in per_worker]
        over, nonfinite = map(sum, zip(*(encode_bounded(layout, vs, sh, slots, out, base)
                                         for vs, out in zip(per_worker, parts))))
        if nonfinite:
            return None
        if not over:
            rounds is not None and rounds.append(1)
            return decode(layout, sum(parts), sh, slots)
    rounds is not None and rounds.append(2)
    m = torch.stack([local_maxima(layout, vs) for vs in per_worker]).max(dim=0).values
    if m[-1] > 0:
        return None
    # the MAX of the codes is the code of the MAX (the network path all-reduces codes)
    sh = shifts(m, slots, base) if block is None else shifts_for(code_exponents(exponent_codes(m)), slots, base)
    total = sum(encode(layout, vs, sh, dtype) for vs in per_worker)
    return decode(layout, total, sh, slots)


class SlotReducer:
    """The reduction of one step on a process group: one collective when a priori bounds
    hold, else two."""

    def __init__(self, layout: Layout, slots: int, device: str = "cpu", waiter: Waiter | None = None,
                 collective: Callable[[object, torch.Tensor, str, Callable[[], bool]], torch.Tensor] | None = None,
                 fmt: str = "int64"):
        self.waiter = waiter
        self.collective = collective  # (pg, tensor, "sum" | "max", should_abort) -> tensor; None: gloo's all-reduce
        self.fmt = fmt
        self.dtype, self.base, self.block = FORMATS[fmt]
        self.layout = blocked(layout, self.block)  # one exponent per segment of this layout
        self.slots = slots
        self.device = device
        self.last_rounds = 0

    def bounds(self, element_bounds: torch.Tensor) -> list[float]:
        """Per-segment bounds (`reduce`'s `bounds`) from a bound per element."""
        return segment_bounds(self.layout, element_bounds)

    def buffer(self) -> torch.Tensor:  # the int64 format's one-round vector: values, then two counters
        return torch.empty(self.layout.total + 2, dtype=self.dtype)

    def wire_rounds(self) -> list[tuple[str, int, int]]:
        """(op, elements, bytes per element) of each collective of a common step, as sent
        (keel.wire.rounds says the same from the parameter count)."""
        if self.block is None:
            return [("sum", self.layout.total + 2, self.dtype.itemsize)]
        return [("max", self.layout.segments + 1, 1), ("sum", self.layout.total, self.dtype.itemsize)]

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
        layout, slots, base = self.layout, self.slots, self.base
        if self.block is not None:
            return self._reduce_blocks(pg, slot_vectors, should_abort, before_comm)
        exps = bound_exponents(bounds)
        if exps is not None:
            sh = shifts_for(exps, slots, base)
            buf = self.buffer()
            buf[-2:] = torch.tensor(encode_bounded(layout, slot_vectors, sh, slots, buf[:-2], base))
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
        sh = shifts(m, slots, base)
        total = self._allreduce(pg, encode(layout, slot_vectors, sh, self.dtype), "sum", should_abort)
        return decode(layout, total, sh, slots)

    def _reduce_blocks(self, pg, slot_vectors, should_abort, before_comm) -> torch.Tensor | None:
        """A block format's step: one byte per block agrees the exponents from the blocks' true
        maxima (MAX), then the fixed-point vector (SUM). Never more, never fewer rounds."""
        layout, slots = self.layout, self.slots
        codes = exponent_codes(local_maxima(layout, slot_vectors))
        before_comm()
        self.last_rounds = 2
        codes = self._allreduce(pg, codes, "max", should_abort)
        if int(codes[-1]):
            return None
        sh = shifts_for(code_exponents(codes), slots, self.base)
        total = self._allreduce(pg, encode(layout, slot_vectors, sh, self.dtype), "sum", should_abort)
        return decode(layout, total, sh, slots)

    def _allreduce(self, pg, t: torch.Tensor, op: str, should_abort: Callable[[], bool]) -> torch.Tensor:
        if self.collective is not None:
            return self.collective(pg, t, op, should_abort)
        import torch.distributed as dist
        if t.dtype == torch.int16:  # gloo has no int16 all-reduce: a ring of point-to-point messages
            from runtime.emulation import hier
            plan = hier.plan_for((tuple(range(pg.size())),), t.numel())
            hier.run_plan(pg, pg.rank(), plan, t, op, 0.0, lambda step, msg, c: 0.0, should_abort, self.waiter)
            return t
        t = t if self.device == "cpu" else t.to(self.device)
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        return allreduce(pg, t, reduce_op, should_abort, self.waiter).cpu()
