"""Fault-free step time of keel's runtime against plain torch DistributedDataParallel on gloo:
same model, same global batch (one slot per worker, the same micro-batches), same world size,
same thread count, run one after the other (twice, alternating, to even out machine noise).

    .venv/bin/python bench/runtime_overhead.py [--workers 4] [--steps 40] [--micro-batch 8]

Prints both medians and the ratio (target <= 1.10)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIO = """
[run]
name = "overhead"
seed = 0
steps = {steps}
[workload]
slots = {workers}
micro_batch = {mb}
[checkpoint]
interval_steps = 100000
[[regions]]
name = "r"
nodes = {workers}
[policy]
heartbeat_s = 0.5
detect_timeout_s = 5.0
[model]
d_model = {d_model}
layers = {layers}
heads = 4
context = {context}
"""


def ddp_worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from keel.scenario import loads
    from runtime.data import Loader, ensure_dataset
    from runtime.model import build_model, build_optimizer, slot_loss

    torch.set_num_threads(1)
    sc = loads(SCENARIO.format(**cfg))
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(build_model(sc.model, sc.run.seed))
    opt = build_optimizer(model.module, sc.model)
    loader = Loader(ensure_dataset(shards=sc.data.shards), sc.run.seed, sc.model.context, sc.workload.micro_batch)
    times = []
    for step in range(sc.run.steps):
        t0 = time.perf_counter()
        b = loader.batch(step, rank)
        opt.zero_grad(set_to_none=True)
        slot_loss(model, b.x, b.y, b.w).backward()  # DDP all-reduces (averages) the gradients
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_ddp(cfg: dict) -> float:
    import torch.multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(ddp_worker, args=(cfg["workers"], port, cfg, out), nprocs=cfg["workers"], start_method="forkserver")
    times = json.loads(Path(out).read_text())
    return statistics.median(times[5:])


def run_keel(cfg: dict) -> float:
    from keel.scenario import loads
    from runtime.api import run_scenario
    with tempfile.TemporaryDirectory() as d:
        summary = run_scenario(loads(SCENARIO.format(**cfg)), Path(d) / "run", progress=False, hangs="")
    return summary["step_time_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    cfg = dict(workers=a.workers, steps=a.steps, mb=a.micro_batch, d_model=a.d_model, layers=a.layers, context=a.context)
    keel, ddp = [], []
    for r in range(a.rounds):
        ddp.append(run_ddp(cfg))
        keel.append(run_keel(cfg))
        print(f"round {r + 1}: ddp {ddp[-1] * 1000:.1f} ms/step, keel {keel[-1] * 1000:.1f} ms/step", file=sys.stderr)
    k, d = statistics.median(keel), statistics.median(ddp)
    kb, db = min(keel), min(ddp)
    print(f"workers {a.workers}, micro-batch {a.micro_batch}, d_model {a.d_model}, layers {a.layers}, context {a.context}, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'':24}{'median ms/step':>16}{'best ms/step':>14}   ({a.rounds} rounds, alternating)")
    print(f"{'torch DDP (gloo)':24}{d * 1000:16.1f}{db * 1000:14.1f}")
    print(f"{'keel runtime':24}{k * 1000:16.1f}{kb * 1000:14.1f}")
    print(f"ratio keel / DDP: median {k / d:.3f}, best {kb / db:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
