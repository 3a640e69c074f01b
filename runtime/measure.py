"""The runtime measures its own primitives (for `keel calibrate`; public as
`runtime.api.measure_primitives`): raw samples, no fitting.

- in a gloo group of `world` processes: one slot's forward and backward with the real model
  and data (one process computing at a time, the others idle), the deterministic slot
  reduction (`runtime.reduction`) at several gradient sizes, and a peer state copy (a broadcast
  of weights and optimizer state);
- checkpoint snapshot, write and read throughput with `runtime.checkpoint` on the real model.
"""
from __future__ import annotations

import datetime as _dt
import socket
import time
from pathlib import Path
from typing import Any, Callable

from keel.errors import RunFailed
from keel.scenario import Scenario

WARMUP = 2  # passes of compute and reduction not timed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_batch(scenario: Scenario):
    import torch
    from runtime.data import Loader, ensure_dataset
    from runtime.model import build_model, build_optimizer
    model = build_model(scenario.model, scenario.run.seed)
    opt = build_optimizer(model, scenario.model)
    loader = Loader(ensure_dataset(shards=scenario.data.shards), scenario.run.seed + 1000,
                    scenario.model.context, scenario.workload.micro_batch)
    return torch, model, opt, loader


def _one_step(model: Any, opt: Any, loader: Any, rank: int) -> None:
    from runtime.model import slot_loss
    b = loader.batch(0, rank)
    slot_loss(model, b.x, b.y, b.w).backward()
    opt.step()


def _time_compute(dist: Any, model: Any, loader: Any, rank: int, world: int, reps: int) -> list[float]:
    """One slot's forward + backward, one process at a time (the others wait at a barrier)."""
    from runtime.model import slot_loss
    compute = []
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            for i in range(reps + WARMUP):
                b = loader.batch(i, rank)
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                slot_loss(model, b.x, b.y, b.w).backward()
                dt = time.perf_counter() - t0
                if i >= WARMUP:
                    compute.append(dt)
    return compute


def _time_reduction(torch: Any, dist: Any, pg: Any, n_params: int, rank: int, world: int,
                    reps: int) -> dict[int, list[float]]:
    """The deterministic slot reduction at 1/4, 1 and 4 times the model's gradient: per
    float32 gradient bytes, this process's time of each repetition."""
    from runtime.reduction import Layout, SlotReducer
    never = lambda: False  # noqa: E731
    sizes = {}
    for factor in (0.25, 1.0, 4.0):
        total = max(1024, int(n_params * factor))
        layout = Layout(tuple([total // 4] * 4 + [1]))
        reducer = SlotReducer(layout, slots=world)
        vec = [torch.randn(layout.total, generator=torch.Generator().manual_seed(rank))]
        times = []
        for i in range(reps + WARMUP):
            dist.barrier()
            t0 = time.perf_counter()
            reducer.reduce(pg, vec, never)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        sizes[layout.total * 4] = times
    return sizes


def _time_state_copy(torch: Any, dist: Any, pg: Any, model: Any, opt: Any, reps: int) -> tuple[int, list[float]]:
    """A peer state copy: weights and optimizer state broadcast from rank 0; (bytes, times)."""
    from runtime.reduction import broadcast
    never = lambda: False  # noqa: E731
    state = torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                      + [v.reshape(-1).float() for st in opt.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.numel() > 1])
    transfer = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        broadcast(pg, state.clone(), 0, never)
        if i >= 1:
            transfer.append(time.perf_counter() - t0)
    return state.numel() * 4, transfer


def _bench_worker(rank: int, world: int, port: int, scenario: Scenario, reps: int, queue: Any) -> None:
    """One process of the micro-benchmark group (spawned); puts its samples on `queue`."""
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        torch, model, opt, loader = _model_and_batch(scenario)
        pg_store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=_dt.timedelta(seconds=120))
        dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=120))
        pg = dist.group.WORLD
        out: dict[str, Any] = {"rank": rank}
        out["slot_compute_s"] = _time_compute(dist, model, loader, rank, world, reps)
        n_params = sum(p.numel() for p in model.parameters())
        out["reduce"] = _time_reduction(torch, dist, pg, n_params, rank, world, reps)
        _one_step(model, opt, loader, rank)  # the optimizer's state exists after a step
        out["state_bytes"], out["state_transfer_s"] = _time_state_copy(torch, dist, pg, model, opt, reps)
        dist.barrier()
        dist.destroy_process_group()
        queue.put(out)
    except BaseException as e:  # reported to the parent, which decides
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def micro_group(scenario: Scenario, world: int, reps: int, timeout_s: float = 300.0) -> list[dict]:
    """The gloo group's samples, one dict per rank (`_bench_worker`), in rank order."""
    import multiprocessing as mp
    # the runtime's own fork server (same preload): torch is imported once, not per process
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["runtime.preload"])
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_bench_worker, args=(r, world, port, scenario, reps, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunFailed(f"calibration micro-benchmark: {world - len(results)} of {world} processes "
                                f"did not report within {timeout_s:.0f} s")
            try:
                results.append(queue.get(timeout=min(left, 5.0)))
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    raise RunFailed("calibration micro-benchmark: its processes died without reporting") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RunFailed(f"calibration micro-benchmark failed: {errors[0]}")
    return sorted(results, key=lambda r: r["rank"])


def checkpoint_throughput(scenario: Scenario, reps: int, workdir: Path) -> dict[str, list[float]]:
    """Snapshot, write and read GB/s of the real model's checkpoint with runtime.checkpoint
    (one warm-up round untimed)."""
    from runtime import checkpoint as C
    torch, model, opt, loader = _model_and_batch(scenario)
    _one_step(model, opt, loader, 0)
    cfg, chash = scenario.to_dict(), scenario.config_hash()
    data_state = loader.state(1)
    snap_rates, write_rates, read_rates = [], [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        snap = C.take_snapshot(step=i + 1, model=model, optimizer=opt, rng=C.capture_rng(), data_state=data_state,
                               config_hash=chash, config=cfg, topology={"calibration": True})
        t1 = time.perf_counter()
        path = C.write_snapshot(workdir / "ckpt-bench", snap, keep=2)
        t2 = time.perf_counter()
        C.load_checkpoint(path, config_hash=chash)
        t3 = time.perf_counter()
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        tensor_bytes = sum(t.numel() * t.element_size() for t in snap.weights.values()) + \
            sum(t.numel() * t.element_size() for t in snap.optimizer_tensors.values())
        if i == 0:
            continue  # warm-up
        snap_rates.append(tensor_bytes / (t1 - t0) / 1e9)
        write_rates.append(nbytes / (t2 - t1) / 1e9)
        read_rates.append(nbytes / (t3 - t2) / 1e9)
    return {"ckpt_snapshot_gbyte_s": snap_rates, "ckpt_write_gbyte_s": write_rates,
            "ckpt_read_gbyte_s": read_rates}


def measure_primitives(scenario: Scenario, reps: int, workdir: str | Path, *, world: int | None = None,
                       progress: Callable[[str], None] | None = None,
                       timeout_s: float = 300.0) -> dict[str, Any]:
    """Raw samples of the runtime's primitives on this machine: {"group": the gloo group's
    per-rank samples (`slot_compute_s`: [s], `reduce`: {gradient bytes: [s]}, `state_bytes`,
    `state_transfer_s`: [s]), "checkpoint": {"ckpt_snapshot_gbyte_s" | "ckpt_write_gbyte_s" |
    "ckpt_read_gbyte_s": [GB/s]}}. `world` defaults to the scenario's training workers."""
    world = world or scenario.training_nodes
    say = progress or (lambda msg: None)
    say(f"micro-benchmarks in a gloo group of {world} processes ({reps} repetitions)")
    group = micro_group(scenario, world, reps, timeout_s)
    say("checkpoint snapshot, write and read")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    return {"group": group, "checkpoint": checkpoint_throughput(scenario, reps, work)}
