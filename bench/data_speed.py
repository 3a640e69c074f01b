"""Samples/second of keel's Loader against a plain torch DataLoader over the same shards, and
the loader's share of a training step of the default model.

    .venv/bin/python bench/data_speed.py [--batches 2000] [--micro-batch 4] [--context 64] [--json]

Both sides produce the same kind of batch (micro_batch windows of context+1 bytes, aligned at
multiples of context, as int64 x and y tensors) from the same in-memory shards; the DataLoader
uses a seeded RandomSampler, batch_size = micro_batch and num_workers = 0 (in-process, like
the runtime's loader), plus one run with 2 worker processes for reference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keel.scenario import Model  # noqa: E402
from runtime.data import Loader, ensure_dataset  # noqa: E402
from runtime.model import build_model, build_optimizer, slot_loss  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """The same aligned windows as the Loader, as a map-style dataset."""

    def __init__(self, data, context: int) -> None:
        self.data = torch.from_numpy(data)
        self.context = context
        self.per_shard = (data.shape[1] - 1) // context

    def __len__(self) -> int:
        return self.data.shape[0] * self.per_shard

    def __getitem__(self, g: int):
        shard, window = divmod(g, self.per_shard)
        row = self.data[shard, window * self.context: window * self.context + self.context + 1].long()
        return row[:-1], row[1:]


def time_keel(loader: Loader, batches: int, slots: int) -> float:
    t0 = time.perf_counter()
    n = 0
    for step in range(batches // slots + 1):
        for slot in range(slots):
            loader.batch(step, slot)
            n += 1
            if n == batches:
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def time_torch(ds: Windows, batches: int, micro_batch: int, workers: int) -> float:
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=batches * micro_batch,
                                             generator=torch.Generator().manual_seed(0))
    dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch, sampler=sampler, num_workers=workers)
    t0 = time.perf_counter()
    for _ in dl:
        pass
    return time.perf_counter() - t0


def time_step(context: int, micro_batch: int, loader: Loader, steps: int = 40) -> float:
    cfg = Model(context=context)
    model = build_model(cfg, 0)
    opt = build_optimizer(model, cfg)
    times = []
    for step in range(steps):
        b = loader.batch(step, 0)
        t0 = time.perf_counter()
        opt.zero_grad()
        slot_loss(model, b.x, b.y, b.w).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--data", default=None, help="dataset directory (default: the runtime's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)

    ds = ensure_dataset(args.data, shards=16)
    loader = Loader(ds, seed=0, context=args.context, micro_batch=args.micro_batch)
    windows = Windows(ds.data, args.context)
    time_keel(loader, 100, args.slots)  # warm up both
    time_torch(windows, 100, args.micro_batch, 0)
    keel_s = min(time_keel(loader, args.batches, args.slots) for _ in range(3))
    torch_s = min(time_torch(windows, args.batches, args.micro_batch, 0) for _ in range(3))
    torch2_s = time_torch(windows, args.batches, args.micro_batch, 2)
    step_s = time_step(args.context, args.micro_batch, loader)
    samples = args.batches * args.micro_batch
    batch_s = keel_s / args.batches
    result = {
        "batches": args.batches, "micro_batch": args.micro_batch, "context": args.context,
        "keel_loader_samples_s": samples / keel_s,
        "torch_dataloader_samples_s": samples / torch_s,
        "torch_dataloader_2workers_samples_s": samples / torch2_s,
        "ratio_keel_over_torch": torch_s / keel_s,
        "keel_batch_ms": 1000 * batch_s,
        "train_step_ms": 1000 * step_s,
        "loader_share_of_step": batch_s / (batch_s + step_s),
        "dataset_version": ds.version,
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"dataset {ds.version[:16]}... ({ds.shards} shards x {ds.shard_bytes} bytes), "
          f"micro_batch {args.micro_batch}, context {args.context}, {args.batches} batches, 1 torch thread")
    print(f"{'':46}{'samples/s':>12}")
    print(f"{'keel Loader':46}{result['keel_loader_samples_s']:>12,.0f}")
    print(f"{'torch DataLoader (workers=0)':46}{result['torch_dataloader_samples_s']:>12,.0f}")
    print(f"{'torch DataLoader (2 workers, start-up incl.)':46}{result['torch_dataloader_2workers_samples_s']:>12,.0f}")
    print(f"ratio keel / torch (workers=0): {result['ratio_keel_over_torch']:.2f}x")
    print(f"one keel micro-batch: {result['keel_batch_ms']:.3f} ms; one training step of the default model "
          f"(fwd+bwd+AdamW, micro_batch {args.micro_batch}): {result['train_step_ms']:.2f} ms; "
          f"loader share of a step: {100 * result['loader_share_of_step']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
