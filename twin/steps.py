"""The step-time model, vectorised: each group's slowest node plus its reduction chain.

A node holding `k` slots at relative speed `v` computes for `k * slot_compute_s / v * (1 + cv Z)`
(Z standard normal, cv = `workload.compute_jitter`), independently per node and step. Per group
of `n` identical nodes (one region, the same slots and speed) one uniform draw U per step gives
the group's maximum exactly, by inverting the maximum's CDF: Z_max = Phi^-1(U^(1/n)). Cost per
step is one draw per *group*, not per node.

The reduction starts from each region as its slowest node gets there, and no phase waits for
the others (twin/topology.py `chains_s`): a group's `offset` is the reduction's longest chain
from its region, and

Step time = max over groups of (group maximum + offset) (+ N(0, jitter) from the links)
            + per-step overhead + the delay of any unmitigated latency spike.

This module owns the distributions only (`StepShape.draw`, `StepShape.expected_s`, the normal
maxima); twin/cost.py builds a `StepShape` from the cluster's state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9).
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
_P_LOW = 0.02425


def _poly(coeffs: tuple[float, ...], x: np.ndarray) -> np.ndarray:
    out = np.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        out = out * x + c
    return out


def normal_quantile_lower(q: np.ndarray) -> np.ndarray:
    """Phi^-1(q) for q in (0, 1), accurate in the lower tail (q small)."""
    q = np.asarray(q, dtype=float)
    out = np.empty_like(q)
    low = q < _P_LOW
    high = q > 1 - _P_LOW
    mid = ~(low | high)
    t = np.sqrt(-2.0 * np.log(q[low]))
    out[low] = _poly(_C, t) / (_poly(_D, t) * t + 1.0)
    r = q[mid] - 0.5
    s = r * r
    out[mid] = _poly(_A, s) * r / (_poly(_B, s) * s + 1.0)
    t = np.sqrt(-2.0 * np.log1p(-q[high]))
    out[high] = -_poly(_C, t) / (_poly(_D, t) * t + 1.0)
    return out


def max_of_normals(u: np.ndarray, n: int) -> np.ndarray:
    """The maximum of n iid standard normals, from uniforms u: Phi^-1(u^(1/n)), computed through
    the upper-tail probability 1 - u^(1/n) so it stays accurate for large n."""
    u = np.clip(u, 1e-300, 1.0)
    upper = -np.expm1(np.log(u) / n)
    upper = np.clip(upper, 1e-300, 1.0 - 1e-16)
    return -normal_quantile_lower(upper)


class NormalPool:
    """Standard-normal maxima drawn from one seeded generator in chunks (numpy's per-call
    overhead dominates small draws), handed out in order: deterministic for a seed."""

    CHUNK = 4096

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._pools: dict[int, tuple[np.ndarray, int]] = {}

    def max_of(self, n: int, count: int) -> np.ndarray:
        """`count` draws of the maximum of `n` iid standard normals."""
        pool, pos = self._pools.get(n, (np.empty(0), 0))
        if pos + count > len(pool):
            fresh = max_of_normals(self.rng.random(max(self.CHUNK, count)), n)
            pool, pos = np.concatenate([pool[pos:], fresh]), 0
        self._pools[n] = (pool, pos + count)
        return pool[pos:pos + count]


def max_cycle_mean(a: dict[str, dict[str, float]]) -> float:
    """The max-plus eigenvalue of the square matrix `a` (a[u][v]: -inf for no edge): the largest
    mean weight of a cycle (Karp, 1978), the period of x_v(k + 1) = max_u x_u(k) + a[u][v]
    once it settles (a strongly connected `a`)."""
    nodes = list(a)
    n = len(nodes)
    d = [{v: 0.0 for v in nodes}]
    for _ in range(n):
        prev = d[-1]
        d.append({v: max(prev[u] + a[u][v] for u in nodes) for v in nodes})
    return max(min((d[n][v] - d[k][v]) / (n - k) for k in range(n) if d[k][v] > -math.inf)
               for v in nodes if d[n][v] > -math.inf)


def settled_ends(a: dict[str, dict[str, float]], rounds: int = 64) -> dict[str, float]:
    """When each region has its result in a step that ran on, relative to the commit (the last
    region's, 0): x_v(k + 1) = max_u x_u(k) + a[u][v] iterated `rounds` times from a common
    start, each time shifted so that its maximum is 0 (it settles within a few rounds to the
    max-plus eigenvector of `a`)."""
    x = {v: 0.0 for v in a}
    for _ in range(rounds):
        x = {v: max(x[u] + a[u][v] for u in a) for v in a}
        top = max(x.values())
        x = {v: t - top for v, t in x.items()}
    return x


def next_end(a: dict[str, dict[str, float]], start: dict[str, float]) -> float:
    """When the last region has its result in a step whose regions start at `start`."""
    return max(start[u] + a[u][v] for u in a for v in a)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step costs under the cluster's current state."""
    groups: tuple[tuple[int, float, float], ...]  # (nodes, fault-free compute s, reduction chain s) per group
    compute_jitter: float
    fixed_s: float          # overhead + spike delay
    latency_s: float        # the reduction's latency term (the link noise never undercuts it)
    link_jitter_s: float    # standard deviation of the per-step link noise
    overlap_s: float = 0.0  # what a step saves on the last when both run on: each region starts
                            # its next step once it has its own result (twin/cost.py)
    cycle: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()  # a[u][v]: region u's slowest
                            # compute + its chain to v's result (twin/cost.py `_cycle`); () for one region

    def draw(self, pool: "NormalPool", count: int, warm: bool = False) -> np.ndarray:
        """`count` step times, one draw per group and step (plus one for the links); each step
        after the first, and the first too where `warm` (the step before it ran on, no pause
        between), `overlap_s` shorter."""
        slowest = None
        for n, base, offset in self.groups:
            if self.compute_jitter > 0:
                z = pool.max_of(n, count)
                group = base * np.maximum(1.0 + self.compute_jitter * z, 0.0) + offset
            else:
                group = np.full(count, base + offset)
            slowest = group if slowest is None else np.maximum(slowest, group)
        out = (slowest if slowest is not None else np.zeros(count)) + self.fixed_s
        if self.link_jitter_s > 0:
            out += np.maximum(self.link_jitter_s * pool.max_of(1, count), -self.latency_s)
        if self.overlap_s > 0:
            i = 0 if warm else 1
            out[i:] = np.maximum(out[i:] - self.overlap_s, 0.0)
        return out

    @property
    def holders(self) -> int:
        """Nodes holding slots."""
        return sum(n for n, _, _ in self.groups)

    def expected_s(self) -> float:
        """A step's expected time once steps run on (the fault-free pace)."""
        return expected_max(self.groups, self.compute_jitter) + self.fixed_s - self.overlap_s


_ERFC = np.frompyfunc(math.erfc, 1, 1)


def expected_max(groups: tuple[tuple[int, float, float], ...], cv: float, points: int = 4001) -> float:
    """E[max over groups of (the group's slowest node + its offset)], by integrating 1 - CDF of
    the maximum."""
    if not groups:
        return 0.0
    top = max(base + offset for _, base, offset in groups)
    if cv == 0:
        return top
    lo = max(0.0, max(offset + base * (1 - 8 * cv) for _, base, offset in groups))  # the max is above every group's floor
    hi = max(offset + base * (1 + 9 * cv) for _, base, offset in groups)
    y = np.linspace(lo, hi, points)
    log_cdf = np.zeros_like(y)
    for n, base, offset in groups:
        z = (y - offset - base) / (cv * base)
        phi = 0.5 * _ERFC(-z / math.sqrt(2)).astype(float)
        log_cdf += n * np.log(np.maximum(phi, 1e-300))
    survival = 1.0 - np.exp(log_cdf)
    return lo + float(np.sum((survival[1:] + survival[:-1]) * 0.5 * np.diff(y)))


@dataclass(slots=True)
class Segment:
    """Steps drawn at once: `cum[i]` is when step first_step + i + 1 commits, after `start`."""
    start: float
    first_step: int
    cum: np.ndarray
    nan: bool = False

    def committed_by(self, t: float) -> int:
        if self.nan:
            return 0
        return int(np.searchsorted(self.cum, t - self.start, side="right"))

    def first_after(self, t: float) -> int:
        return int(np.searchsorted(self.cum, t - self.start, side="right"))

    def commit_time(self, index: int) -> float:
        return self.start + float(self.cum[index])
