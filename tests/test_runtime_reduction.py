"""The deterministic reduction over slots (no processes)."""
from __future__ import annotations

import itertools
import math
import random
import threading
import time

import pytest
import torch

from runtime.reduction import Layout, decode, encode, encode_bounded, local_maxima, reduce_local, shifts
from runtime.waiting import Aborted, CollectiveError, Waiter


def _slots(n_slots: int, sizes: tuple[int, ...], seed: int = 0, spread: float = 8.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_slots):
        parts = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread / 4)
                 for n in sizes]
        out.append(torch.cat(parts).float())
    return out


def _partitions(n_slots: int, rng: random.Random, count: int = 6):
    idx = list(range(n_slots))
    yield [idx]  # one worker
    yield [[i] for i in idx]  # one slot per worker
    for _ in range(count):
        rng.shuffle(idx)
        cuts = sorted(rng.sample(range(1, n_slots), rng.randint(1, n_slots - 1)))
        yield [idx[a:b] for a, b in zip([0] + cuts, cuts + [n_slots])]


def test_independent_of_partition_and_order():
    layout = Layout((50, 7, 300, 1))
    vecs = _slots(8, layout.sizes)
    ref = reduce_local(layout, [vecs], 8)
    rng = random.Random(1)
    for parts in _partitions(8, rng):
        per_worker = [[vecs[i] for i in p] for p in parts]
        got = reduce_local(layout, per_worker, 8)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), parts
        got_rev = reduce_local(layout, list(reversed(per_worker)), 8)
        assert torch.equal(got_rev.view(torch.int32), ref.view(torch.int32))


def test_within_float32_rounding_of_the_plain_mean():
    for n_slots, seed in itertools.product((1, 2, 3, 8, 44), (0, 1)):
        layout = Layout((64, 1000, 3, 1))
        vecs = _slots(n_slots, layout.sizes, seed)
        got = reduce_local(layout, [vecs], n_slots)
        exact = torch.stack([v.double() for v in vecs]).mean(0)
        plain = torch.stack(vecs).mean(0)
        # as close to the exact mean as float32 allows: at most 1 ulp of it
        ulp = torch.finfo(torch.float32).eps * exact.abs().float()
        tiny = 2.0 ** -60 * max(float(v.abs().max()) for v in vecs)
        assert bool(((got.double() - exact).abs() <= ulp.double() + tiny).all()), n_slots
        # and at least as close as the plain float32 mean, up to one rounding
        plain_err = (plain.double() - exact).abs()
        assert bool(((got.double() - exact).abs() <= plain_err + ulp.double() + tiny).all())


def test_zero_tensors_and_exact_small_integers():
    layout = Layout((4, 4))
    vecs = [torch.tensor([1, 2, 3, 4, 0, 0, 0, 0], dtype=torch.float32),
            torch.tensor([3, 2, 1, 0, 0, 0, 0, 0], dtype=torch.float32)]
    got = reduce_local(layout, [vecs[:1], vecs[1:]], 2)
    assert got.tolist() == [2, 2, 2, 2, 0, 0, 0, 0]


def test_non_finite_anywhere_is_flagged():
    layout = Layout((5, 1))
    vecs = _slots(3, layout.sizes)
    vecs[1][2] = float("nan")
    assert local_maxima(layout, vecs[1:2])[-1] == 1.0
    assert reduce_local(layout, [vecs[:1], vecs[1:]], 3) is None
    vecs[1][2] = float("inf")
    assert reduce_local(layout, [vecs], 3) is None


def test_no_overflow_at_the_extremes():
    layout = Layout((3,))
    big = torch.tensor([3.0e38, -3.0e38, 1.0], dtype=torch.float32)
    small = torch.tensor([1e-45, -1e-45, 0.0], dtype=torch.float32)
    for v, n in ((big, 44), (small, 44)):
        m = local_maxima(layout, [v] * n)
        sh = shifts(m, n)
        total = encode(layout, [v] * n, sh)
        got = decode(layout, total, sh, n)
        assert torch.equal(got[:2], v[:2]), (v, got)
        assert abs(float(got[2]) - float(v[2])) <= 2.0 ** -50 * float(v.abs().max())


def test_one_round_with_bounds_is_partition_independent_and_accurate():
    layout = Layout((50, 7, 300, 1))
    vecs = _slots(8, layout.sizes, seed=3, spread=2.0)
    exact = torch.stack([v.double() for v in vecs]).mean(0)
    segs = torch.split(torch.stack(vecs).abs().max(0).values, list(layout.sizes))
    bounds = [float(x.max()) * 1.5 for x in segs]  # holds: one round
    ref = reduce_local(layout, [vecs], 8, bounds)
    for parts in _partitions(8, random.Random(2)):
        got = reduce_local(layout, [[vecs[i] for i in p] for p in parts], 8, bounds)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    ulp = torch.finfo(torch.float32).eps * exact.abs()
    assert bool(((ref.double() - exact).abs() <= ulp + 2.0 ** -50).all())
    # a bound that does not hold for one slot: every partition falls back to two rounds alike
    tight = list(bounds)
    tight[2] = float(segs[2].max()) * 0.5
    two = reduce_local(layout, [vecs], 8)
    for parts in _partitions(8, random.Random(3)):
        got = reduce_local(layout, [[vecs[i] for i in p] for p in parts], 8, tight)
        assert torch.equal(got.view(torch.int32), two.view(torch.int32))
    # a zero bound admits only zeros
    assert torch.equal(reduce_local(layout, [vecs], 8, [0.0] + bounds[1:]).view(torch.int32), two.view(torch.int32))


def _below(n: int, exp_hi: int, seed: int) -> torch.Tensor:
    """n float32 values of either sign below 2**exp_hi, exponents down to the subnormals."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-160, exp_hi, (n,), generator=g).double()
    v = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5) * torch.exp2(e - 1) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return v.float()


def test_encoding_is_exact_in_either_precision():
    # shifts where 2^shift is a normal float32 (the float32 path), and one beyond (float64)
    for shifts_ in ((127, -126, 61, 0, 90), (128, 3), (-127, 20)):
        layout = Layout((500,) * len(shifts_))
        v = torch.cat([_below(500, min(128, 61 - s), seed=i) for i, s in enumerate(shifts_)])
        ref = torch.round(v.double() * torch.repeat_interleave(
            torch.tensor([math.ldexp(1.0, s) for s in shifts_], dtype=torch.float64), 500)).long()
        assert torch.equal(encode(layout, [v], shifts_), ref), shifts_
        assert torch.equal(encode(layout, [v, -v, v], shifts_), ref), shifts_


def test_bounds_path_counters():
    layout = Layout((3, 2))
    sh = (50, 55)  # 2 slots: bounds 2^10 and 2^5
    ok = torch.tensor([1000.0, -3.0, 0.5, 31.0, -31.0])
    out = torch.empty(5, dtype=torch.int64)
    assert encode_bounded(layout, [ok, ok], sh, 2, out) == (0, 0)
    assert torch.equal(out, encode(layout, [ok, ok], sh))
    over = ok.clone()
    over[4] = -32.0
    huge = ok.clone()
    huge[3] = 3e38  # scaled by 2^55 in float32: inf, yet finite
    nan = ok.clone()
    nan[1] = float("nan")
    for slots_, want in (([ok, over], (1, 0)), ([huge], (1, 0)), ([nan, ok], (0, 1)), ([over, nan], (0, 1)),
                         ([ok, torch.tensor([0, 0, float("-inf"), 0, 0])], (0, 1))):
        out = torch.full((5,), 7, dtype=torch.int64)
        assert encode_bounded(layout, slots_, sh, 2, out) == want
        assert not out.any()


class _Work:
    """Async work as gloo gives it: its future completes a moment before is_completed() turns true."""

    def __init__(self):
        self.fut = torch.futures.Future()
        self.done_at = math.inf
        self.fut.add_done_callback(lambda _: setattr(self, "done_at", time.monotonic()))

    def is_completed(self):
        return time.monotonic() > self.done_at + 0.002

    def get_future(self):
        return self.fut

    def wait(self):
        self.fut.wait()
        return True


def _waiter() -> Waiter:
    w = Waiter()
    w.safety_net_s = 10.0  # so only the events can end a wait quickly
    return w


def test_waiter_wakes_on_completion_abort_and_error():
    work = _Work()
    threading.Timer(0.02, lambda: work.fut.set_result(None)).start()
    t0 = time.perf_counter()
    _waiter().wait(work, lambda: False)
    assert time.perf_counter() - t0 < 2.0

    waiter, flag = _waiter(), threading.Event()

    def abort():
        flag.set()
        waiter.interrupt()
    threading.Timer(0.02, abort).start()
    t0 = time.perf_counter()
    with pytest.raises(Aborted):
        waiter.wait(_Work(), flag.is_set)  # never completes
    assert time.perf_counter() - t0 < 2.0

    work = _Work()
    threading.Timer(0.01, lambda: work.fut.set_exception(RuntimeError("Connection closed by peer"))).start()
    with pytest.raises(CollectiveError):
        _waiter().wait(work, lambda: False)
