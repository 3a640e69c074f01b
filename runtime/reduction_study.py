"""The reduction's formats on real gradients of the built-in job, without processes: what the
accuracy test (tests/test_reduction_formats.py) and bench/reduction.py measure.

`slot_gradients` trains the scenario's model for some steps (exact reduction, AdamW, as the
runtime does) and returns the slots' vectors of the next step with the a priori bounds the
runtime would use then. `ring_mean` is what a plain ring all-reduce in a float dtype computes
(each chunk summed around the ring in that dtype, one slot per worker), the comparison.
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime.reduction import Layout, blocked, moment_bounds, reduce_local, segment_bounds, FORMATS


def slot_gradients(scenario, steps: int, slots: int, fmt: str = "int64"):
    """(layout, per-slot vectors of step `steps`, per-element bounds or None): the built-in
    job trained `steps` steps on `slots` slots with the exact reduction in `fmt`."""
    from runtime.job_run import BoundJob, load_spec
    job = BoundJob(load_spec(scenario), scenario)
    opt, params = job.optimizer, job.params
    layout = Layout(job.sizes + (1,))

    def vectors(step: int) -> list[torch.Tensor]:
        return [job.slot_vector(step, slot)[0] for slot in range(slots)]

    for step in range(steps):
        job.apply(reduce_local(layout, [vectors(step)], slots, bounds(layout, opt, params, fmt), fmt))
    return layout, vectors(steps), element_bounds(opt, params)


def element_bounds(opt, params) -> torch.Tensor | None:
    moments = [opt.state[p]["exp_avg"] for p in params if p in opt.state]
    return moment_bounds(moments) if len(moments) == len(params) else None


def bounds(layout: Layout, opt, params, fmt: str) -> list[float] | None:
    eb = element_bounds(opt, params)
    return None if eb is None else segment_bounds(blocked(layout, FORMATS[fmt][2]), eb)


def ring_mean(vectors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """float64: the mean a ring all-reduce in `dtype` computes, one slot per worker: chunk c of
    W is summed in `dtype` from worker c + 1 around the ring (reduce-scatter), then / W."""
    w = len(vectors)
    n = vectors[0].numel()
    out = torch.empty(n, dtype=torch.float64)
    vs = [v.to(dtype) for v in vectors]
    for c in range(w):
        lo, hi = c * n // w, (c + 1) * n // w
        acc = vs[(c + 1) % w][lo:hi].clone()
        for j in range(2, w + 1):
            acc = acc + vs[(c + j) % w][lo:hi]
        out[lo:hi] = (acc / w).double()  # the division in dtype as well, as DDP averages
    return out


def errors(got: torch.Tensor, exact: torch.Tensor, layout: Layout) -> dict[str, float]:
    """rel_l2: |got - exact| / |exact| over the gradient; worst_tensor: the largest of that per
    tensor; max_abs_rel: max |got - exact| / max |exact| over the gradient."""
    d = got.double()[:-1] - exact[:-1]
    e = exact[:-1]
    per = [float(a.norm() / b.norm()) if float(b.norm()) > 0 else float(a.norm())
           for a, b in zip(d.split(layout.sizes[:-1]), e.split(layout.sizes[:-1]))]
    return {"rel_l2": float(d.norm() / e.norm()), "worst_tensor": max(per),
            "max_abs_rel": float(d.abs().max() / e.abs().max())}
