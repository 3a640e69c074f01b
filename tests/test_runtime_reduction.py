"""The deterministic reduction over slots (no processes)."""
from __future__ import annotations

import itertools
import random

import torch

from runtime.reduction import Layout, decode, encode, local_maxima, reduce_local, shifts


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
