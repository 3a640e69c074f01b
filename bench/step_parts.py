"""What a keel worker does in a step beyond what a DDP worker does, timed part by part in one
process on one thread (no collectives, no other process): the job's forward and backward
(`BoundJob.slot_vector`), the a priori bounds the worker computes every step (`_bounds`:
`moment_bounds` over the optimizer's first moments), the block format's exponents (local
maxima, codes), its encoding and decoding, and the optimizer step (`BoundJob.apply`); beside
them a DDP worker's forward and backward and optimizer step on the same job, without DDP.

    .venv/bin/python bench/step_parts.py [SCENARIO ...] [--steps 40] [--format block32]

Default scenarios: bench/peers-4.toml (keel's GPT) and bench/peers-4-llama.toml (the
transformers example). Milliseconds per step, the mean over `--steps` after 5.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("slot_vector", "bounds", "exponents", "encode", "decode", "apply", "plain fwd/bwd", "plain step")


def parts(scenario: str, steps: int, fmt: str) -> dict[str, float]:
    from keel.scenario import load
    from runtime import reduction as R
    from runtime.job import slot_generator
    from runtime.job_run import BoundJob, load_spec
    sc = load(scenario)
    job = BoundJob(load_spec(sc), sc)
    red = R.SlotReducer(R.Layout(job.sizes + (1,)), sc.slot_count, fmt=fmt)
    total = dict.fromkeys(PARTS, 0.0)
    for step in range(steps + 5):
        t0 = time.perf_counter()
        v, _ = job.slot_vector(step, 0)
        t1 = time.perf_counter()
        m = job.first_moments()
        _ = None if m is None else red.bounds(R.moment_bounds(m))
        t2 = time.perf_counter()
        codes = R.exponent_codes(R.local_maxima(red.layout, [v]))
        t3 = time.perf_counter()
        sh = R.shifts_for(R.code_exponents(codes), sc.slot_count, red.base)
        enc = R.encode(red.layout, [v], sh, red.dtype)
        t4 = time.perf_counter()
        mean = R.decode(red.layout, enc * sc.slot_count, sh, sc.slot_count)
        t5 = time.perf_counter()
        job.apply(mean)
        t6 = time.perf_counter()
        job.optimizer.zero_grad(set_to_none=True)
        b = job.loader.batch(step, 1)
        job.spec.job.loss(job.model, b.data, slot_generator(job.seed, step, 1)).backward()
        t7 = time.perf_counter()
        job.optimizer.step()
        t8 = time.perf_counter()
        job.model.zero_grad(set_to_none=True)
        if step >= 5:
            for k, d in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7)):
                total[k] += d
    return {k: 1000 * x / steps for k, x in total.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", default=["bench/peers-4.toml", "bench/peers-4-llama.toml"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--format", default="block32", choices=("block32", "block16"))
    a = p.parse_args()
    torch.set_num_threads(1)  # as each worker computes
    for s in a.scenarios:
        ms = parts(s, a.steps, a.format)
        print(f"{s}: " + ", ".join(f"{k} {x:.2f} ms" for k, x in ms.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
