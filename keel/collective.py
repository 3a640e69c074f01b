"""The hierarchical all-reduce's plan: which message goes from which rank to which, step by
step (runtime/emulation/hier.py sends it for real and says how it is built). A pure function
of the ring's membership, so the twin can follow the plan too (twin/topology.py: a latency
spike on one node, at node level) without importing the runtime."""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence


class Msg(NamedTuple):
    src: int     # rank
    dst: int
    offset: int  # elements of the vector
    length: int


class Step(NamedTuple):
    index: int
    phase: str                # "intra-reduce" | "inter-reduce" | "inter-gather" | "intra-gather"
    combine: str              # "reduce": op into the receiver's slice; "copy": overwrite it
    msgs: tuple[Msg, ...]


def _chunks(length: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of n balanced chunks of range(length)."""
    return [(k * length // n, (k + 1) * length // n) for k in range(n)]


def build_plan(regions: Sequence[Sequence[int]], length: int, exchange: bool = False) -> tuple[Step, ...]:
    """The plan for ranks grouped by region (regions in ring order) and a vector of `length`.
    `exchange`: across regions one step instead of the ring's 2 (R - 1): every owner sends its
    chunk to the overlapping owners of every other region at once (R - 1 times the bytes, one
    crossing's latency: for the block formats' small vector of exponents, reduction.py)."""
    regions = [list(r) for r in regions if r]
    raw: list[tuple[str, str, list[Msg]]] = []

    def msg(src: int, dst: int, lo: int, hi: int) -> list[Msg]:
        return [Msg(src, dst, lo, hi - lo)] if hi > lo else []

    chunks = [_chunks(length, len(r)) for r in regions]
    longest = max((len(r) for r in regions), default=0)

    def intra_rings(phase: str, combine: str, first: int) -> None:
        """Every region's ring at once: at step s member i sends chunk (i + first - s) mod n."""
        for s in range(longest - 1):
            out = []
            for members, ch in zip(regions, chunks):
                n = len(members)
                if s < n - 1:
                    for i in range(n):
                        out += msg(members[i], members[(i + 1) % n], *ch[(i + first - s) % n])
            raw.append((phase, combine, out))

    intra_rings("intra-reduce", "reduce", 0)

    R = len(regions)
    if R > 1:
        parts = _chunks(length, R)
        owned = [[(members[i], ch[(i + 1) % len(members)]) for i in range(len(members))]
                 for members, ch in zip(regions, chunks)]

        def across(a: int, k: int, b: int | None = None) -> list[Msg]:
            b = (a + 1) % R if b is None else b
            lo_k, hi_k = parts[k] if k >= 0 else (0, length)
            out = []
            for src, (lo_i, hi_i) in owned[a]:
                for dst, (lo_j, hi_j) in owned[b]:
                    out += msg(src, dst, max(lo_k, lo_i, lo_j), min(hi_k, hi_i, hi_j))
            return out

        if exchange:
            raw.append(("inter-exchange", "reduce", [m for a in range(R) for b in range(R) if b != a
                                                     for m in across(a, -1, b)]))
        for s in range(R - 1 if not exchange else 0):
            raw.append(("inter-reduce", "reduce", [m for a in range(R) for m in across(a, (a - s) % R)]))
        for s in range(R - 1 if not exchange else 0):
            raw.append(("inter-gather", "copy", [m for a in range(R) for m in across(a, (a + 1 - s) % R)]))

    intra_rings("intra-gather", "copy", 1)

    steps = [(phase, combine, msgs) for phase, combine, msgs in raw if msgs]
    return tuple(Step(i, phase, combine, tuple(msgs)) for i, (phase, combine, msgs) in enumerate(steps))


@functools.lru_cache(maxsize=64)
def plan_for(regions: tuple[tuple[int, ...], ...], length: int, exchange: bool = False) -> tuple[Step, ...]:
    """`build_plan`, cached (a generation reuses two or three plans every step)."""
    return build_plan(regions, length, exchange)

