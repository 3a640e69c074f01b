"""keel's checkpoints against torch.distributed.checkpoint and against the disk itself: the same
model and optimizer state (keel's GPT at a larger size, one AdamW step taken) saved by

- keel sync (`runtime.checkpoint.save_checkpoint`: the seven fields, fsynced, manifest, rename),
- keel async (`AsyncCheckpointer.snapshot_and_submit`: snapshot, then the write in a thread),
- `torch.distributed.checkpoint.save` and `async_save` (FileSystemWriter, files fsynced),
- a raw sequential write of as many bytes with one fsync (the disk's limit here),

each `--repeats` times, interleaved. Per method: the training stall (the time the caller is
blocked) and the write throughput (bytes on disk / time until the checkpoint is durable).

    .venv/bin/python bench/ckpt_compare.py [--d-model 384] [--layers 6] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("keel_sync", "keel_async", "dcp_save", "dcp_async_save", "raw_fsync")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(d_model: int, layers: int):
    from keel.scenario import Model
    from runtime.model import build_model, build_optimizer, slot_loss
    cfg = Model(d_model=d_model, layers=layers, heads=4, context=64)
    model = build_model(cfg, 0)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    slot_loss(model, x, x, torch.ones(2)).backward()
    opt.step()  # AdamW's state exists
    return model, opt


def keel_args(model, opt) -> dict:
    from runtime.train_state import capture_rng
    return dict(step=1, model=model, optimizer=opt, rng=capture_rng(),
                data_state={"sampler": "bench", "version": "bench", "seed": 0, "step": 1},
                config_hash="0" * 64, config={"bench": True}, topology={"members": ["bench"]})


def keel_sync(model, opt, where: Path) -> tuple[float, float, int]:
    from runtime.checkpoint import save_checkpoint
    t0 = time.perf_counter()
    path = save_checkpoint(where, keep=1, **keel_args(model, opt))
    total = time.perf_counter() - t0
    return total, total, dir_bytes(path)


def keel_async(model, opt, where: Path) -> tuple[float, float, int]:
    from runtime.checkpoint import AsyncCheckpointer
    ck = AsyncCheckpointer(where, keep=1)
    t0 = time.perf_counter()
    stall = ck.snapshot_and_submit(**keel_args(model, opt))
    path = ck.wait()
    total = time.perf_counter() - t0
    assert ck.last_error is None and path is not None, ck.last_error
    return stall, total, dir_bytes(path)


def dcp_state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def dcp_save(model, opt, where: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    dcp.save(dcp_state(model, opt), checkpoint_id=str(where))
    total = time.perf_counter() - t0
    return total, total, dir_bytes(where)


def dcp_async_save(model, opt, where: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=str(where))
    stall = time.perf_counter() - t0
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    total = time.perf_counter() - t0
    return stall, total, dir_bytes(where)


def raw_fsync(nbytes: int, where: Path) -> tuple[float, float, int]:
    where.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(where / "raw.bin", "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    total = time.perf_counter() - t0
    return total, total, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory under the repository, on its disk)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import datetime
    import torch.distributed as dist
    if not dist.is_initialized():  # DCP's async_save wants a group; one rank of gloo
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, opt = build(args.d_model, args.layers)
    params = sum(t.numel() for t in model.parameters())
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix=".ckpt-compare-", dir=ROOT / "bench"))
    rows: dict[str, list[tuple[float, float, int]]] = {m: [] for m in METHODS}
    from keel.progress import progress_bar
    try:
        nbytes = 0
        with progress_bar(total=args.repeats * len(METHODS), desc="checkpoints", unit="save") as bar:
            for rep in range(args.repeats):
                for m in METHODS[rep % (len(METHODS) - 1):-1] + METHODS[:rep % (len(METHODS) - 1)] + ("raw_fsync",):
                    where = base / f"{m}-{rep}"
                    if m == "raw_fsync":
                        r = raw_fsync(nbytes, where)
                    else:
                        r = globals()[m](model, opt, where)
                        nbytes = max(nbytes, r[2])
                    rows[m].append(r)
                    shutil.rmtree(where, ignore_errors=True)
                    bar.update()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()
    result = {"params": params, "d_model": args.d_model, "layers": args.layers, "repeats": args.repeats,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "methods": {}}
    for m, rs in rows.items():
        stalls, totals = [r[0] for r in rs], [r[1] for r in rs]
        mbs = [r[2] / r[1] / 1e6 for r in rs]
        result["methods"][m] = {"stall_s": statistics.median(stalls), "stall_s_range": [min(stalls), max(stalls)],
                                "durable_s": statistics.median(totals), "bytes": rs[-1][2],
                                "write_mb_s": statistics.median(mbs), "write_mb_s_range": [min(mbs), max(mbs)]}
    raw = result["methods"]["raw_fsync"]["write_mb_s"]
    for m, r in result["methods"].items():
        r["throughput_of_raw"] = r["write_mb_s"] / raw
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"keel GPT d_model {args.d_model}, {args.layers} layers: {params / 1e6:.1f} M parameters + AdamW state; "
          f"median [min-max] of {args.repeats}, interleaved")
    print(f"{'method':16}{'bytes':>14}{'stall s':>22}{'durable s':>11}{'write MB/s':>24}{'of raw':>8}")
    for m, r in result["methods"].items():
        print(f"{m:16}{r['bytes']:>14,}{r['stall_s']:>9.3f} [{r['stall_s_range'][0]:.3f}-{r['stall_s_range'][1]:.3f}]"
              f"{r['durable_s']:>11.3f}{r['write_mb_s']:>9.0f} [{r['write_mb_s_range'][0]:.0f}-{r['write_mb_s_range'][1]:.0f}]"
              f"{r['throughput_of_raw']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
