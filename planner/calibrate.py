"""`keel calibrate`: measure, on this machine, every primitive the twin needs to model the
runtime (twin/params.py lists them), with the machine and versions they were measured on.

Nothing is typed in by hand. Three kinds of measurement, each repeated:
- micro-benchmarks in a gloo group of as many processes as the local scenario has training
  workers: one slot's forward and backward with the real model and data (one process computing
  at a time, the others idle), the deterministic slot reduction (`runtime.reduction`) at
  several gradient sizes (fitted as latency + bytes / bandwidth), and a peer state copy
  (a broadcast of weights and optimizer state);
- checkpoint snapshot, write and read throughput with `runtime.checkpoint` on the real model;
- short real runs through `runtime.api.run_scenario` of the local scenario's shape with
  their own fault schedule (a killed worker taken over by the hot spare, a hung worker, a
  killed worker under `checkpoint_restart`), read from their event logs: detection, re-forming,
  take-over and restart times, and the fault-free step time (whose part beyond compute and
  reduction is `step_overhead_s`).
The runs use another seed and schedule than any scenario they later validate.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from keel import scenario as S
from keel.errors import RunFailed

UNITS = {
    "slot_compute_s": "s", "step_overhead_s": "s", "reduce_latency_s": "s", "reduce_gbyte_s": "GB/s",
    "detect_kill_s": "s", "detect_hang_s": "s", "reform_s": "s", "state_transfer_gbyte_s": "GB/s",
    "spare_takeover_s": "s", "ckpt_snapshot_gbyte_s": "GB/s", "ckpt_write_gbyte_s": "GB/s",
    "ckpt_read_gbyte_s": "GB/s", "restart_s": "s",
}
OPTIONAL = {"spike_rounds": "rounds",  # the twin takes it where given
            "detect_rack_s": "s",
            "host_pace_per_worker": "1/worker",
            "spike_tail_s": "s"}  # the twin takes these where given
PRIMITIVES = tuple(UNITS)
PACE_STEPS = 30  # a fault-free pace run's length (calibrate's and validate's)


# ----------------------------------------------------------------------------- the record

def machine() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cpu_model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu_model)
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_bytes": mem}


def versions() -> dict[str, Any]:
    import importlib.metadata as md
    out: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "simpy", "networkx", "optuna", "keel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        from runtime.checkpoint import current_commit_sha
        out["commit_sha"] = current_commit_sha()
    except Exception:  # calibration must not fail on a missing git
        out["commit_sha"] = "unknown"
    return out


def entry(samples: Sequence[float], unit: str, **extra: Any) -> dict[str, Any]:
    xs = sorted(float(x) for x in samples)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0], xs[0], xs[0]]
    return {"median": statistics.median(xs), "spread": [xs[0], xs[-1]], "iqr": [q[0], q[2]],
            "samples": [float(x) for x in samples], "n": len(xs), "unit": unit, **extra}


# ----------------------------------------------------------------------------- micro-benchmarks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_batch(scenario: S.Scenario):
    import torch
    from runtime.data import Loader, ensure_dataset
    from runtime.model import build_model, build_optimizer
    model = build_model(scenario.model, scenario.run.seed)
    opt = build_optimizer(model, scenario.model)
    loader = Loader(ensure_dataset(shards=scenario.data.shards), scenario.run.seed + 1000,
                    scenario.model.context, scenario.workload.micro_batch)
    return torch, model, opt, loader


def _bench_worker(rank: int, world: int, port: int, scenario: S.Scenario, reps: int, queue: Any) -> None:
    """One process of the micro-benchmark group (spawned)."""
    try:
        import torch
        import torch.distributed as dist
        from runtime.model import slot_loss
        from runtime.reduction import Layout, SlotReducer, broadcast
        torch.set_num_threads(1)
        torch, model, opt, loader = _model_and_batch(scenario)
        pg_store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=_dt.timedelta(seconds=120))
        dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=120))
        pg = dist.group.WORLD
        never = lambda: False  # noqa: E731
        out: dict[str, Any] = {"rank": rank}

        # one slot's forward + backward, one process at a time (the others wait at a barrier)
        compute = []
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                for i in range(reps + 2):
                    b = loader.batch(i, rank)
                    t0 = time.perf_counter()
                    model.zero_grad(set_to_none=True)
                    slot_loss(model, b.x, b.y, b.w).backward()
                    dt = time.perf_counter() - t0
                    if i >= 2:  # two warm-up passes
                        compute.append(dt)
        out["slot_compute_s"] = compute

        # the deterministic slot reduction at several gradient sizes
        n_params = sum(p.numel() for p in model.parameters())
        sizes = {}
        for factor in (0.25, 1.0, 4.0):
            total = max(1024, int(n_params * factor))
            layout = Layout(tuple([total // 4] * 4 + [1]))
            reducer = SlotReducer(layout, slots=world)
            vec = [torch.randn(layout.total, generator=torch.Generator().manual_seed(rank))]
            times = []
            for i in range(reps + 2):
                dist.barrier()
                t0 = time.perf_counter()
                reducer.reduce(pg, vec, never)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            sizes[layout.total * 4] = times  # float32 gradient bytes
        out["reduce"] = sizes

        # a peer state copy: weights and optimizer state broadcast from rank 0
        b = loader.batch(0, rank)
        slot_loss(model, b.x, b.y, b.w).backward()
        opt.step()
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
        out["state_bytes"] = state.numel() * 4
        out["state_transfer_s"] = transfer
        dist.barrier()
        dist.destroy_process_group()
        queue.put(out)
    except BaseException as e:  # reported to the parent, which decides
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def micro_group(scenario: S.Scenario, world: int, reps: int, timeout_s: float = 300.0) -> list[dict]:
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


def fit_affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def reduce_primitives(results: list[dict]) -> tuple[list[float], list[float], dict]:
    """Per repetition: fit latency + bytes * s_per_byte over the sizes (the slowest rank's time
    is the collective's); returns (latencies, bandwidths GB/s, the medians per size)."""
    sizes = sorted(results[0]["reduce"], key=float)
    reps = len(results[0]["reduce"][sizes[0]])
    lat, bw = [], []
    for i in range(reps):
        xs = [float(s) for s in sizes]
        ys = [max(r["reduce"][s][i] for r in results) for s in sizes]
        a, b = fit_affine(xs, ys)
        lat.append(max(0.0, a))
        bw.append(1.0 / b / 1e9 if b > 0 else float("inf"))
    per_size = {str(s): statistics.median(max(r["reduce"][s][i] for r in results) for i in range(reps))
                for s in sizes}
    finite = [x for x in bw if x != float("inf")] or [1e3]
    return lat, finite, per_size


def checkpoint_throughput(scenario: S.Scenario, reps: int, workdir: Path) -> dict[str, list[float]]:
    """Snapshot, write and read GB/s of the real model's checkpoint with runtime.checkpoint."""
    from runtime import checkpoint as C
    from runtime.model import slot_loss
    torch, model, opt, loader = _model_and_batch(scenario)
    b = loader.batch(0, 0)
    slot_loss(model, b.x, b.y, b.w).backward()
    opt.step()
    cfg = scenario.to_dict()
    chash = scenario.config_hash()
    data_state = loader.state(1)
    topo = {"calibration": True}
    snap_rates, write_rates, read_rates = [], [], []
    run_dir = workdir / "ckpt-bench"
    for i in range(reps + 1):
        t0 = time.perf_counter()
        snap = C.take_snapshot(step=i + 1, model=model, optimizer=opt, rng=C.capture_rng(), data_state=data_state,
                               config_hash=chash, config=cfg, topology=topo)
        t1 = time.perf_counter()
        path = C.write_snapshot(run_dir, snap, keep=2)
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


# ----------------------------------------------------------------------------- real runtime runs

def calibration_scenario(base: S.Scenario, *, steps: int, schedule: Sequence[Mapping[str, Any]],
                         overrides: Mapping[str, Any] | None = None) -> S.Scenario:
    """The local scenario's shape with a calibration seed and schedule of its own."""
    from planner.scenarios import plain
    raw = plain(base)
    raw["run"]["name"] = f"{base.run.name}-calibration"
    raw["run"]["seed"] = base.run.seed + 1000
    raw["run"]["steps"] = steps
    raw["faults"] = {"schedule": [dict(e) for e in schedule]}
    raw["checkpoint"]["interval_steps"] = max(1, steps // 3)
    for key, value in (overrides or {}).items():
        S.apply_override(raw, key, value, base.source)
    return S.from_dict(raw, base.source)


def _episode_times(events: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Per fault_id: the time of its first event of each kind, and the detail of each."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        fid = e.detail.get("fault_id")
        if fid is None:
            continue
        ep = out.setdefault(fid, {"class": e.fault, "target": e.target, "t": {}, "detail": {}})
        ep["t"].setdefault(e.kind, e.t)
        ep["detail"].setdefault(e.kind, e.detail)
    return out


def generation_pace(events: Sequence[Any], gen: int) -> float | None:
    """The mean step of generation `gen` past its first commit (the redone step) and up to
    the next fault: what the twin adds for the step a recovery redoes, at the membership it
    redoes it with. None where fewer than two such commits."""
    commits = []
    for e in events:
        if e.kind == "step" and e.detail.get("gen") == gen:
            commits.append(e)
        elif e.kind == "fault" and commits:
            break
    if len(commits) < 2 or commits[-1].step == commits[0].step:
        return None
    return throughput_step_s(commits, warmup=0)


def _first_commit_after(events: Sequence[Any], t: float) -> float | None:
    return next((e.t for e in events if e.kind == "step" and e.t > t), None)


def run_runtime(scenario: S.Scenario, out_dir: Path, hangs: str | None = None,
                failures: list[dict[str, str]] | None = None) -> tuple[dict, list]:
    """One real run; a run that fails is recorded and tried once more in a fresh directory
    (a calibration measures primitives, one flaky run must not void it; the record says so)."""
    from keel.events import read_events
    from runtime.api import run_scenario
    try:
        summary = run_scenario(scenario, out_dir, progress=False, hangs=hangs)
    except RunFailed as e:
        if failures is not None:
            failures.append({"run": str(out_dir), "error": str(e)})
        print(f"calibrate: runtime run {out_dir} failed ({e}); trying it once more", file=sys.stderr)
        out_dir = Path(f"{out_dir}-retry")
        summary = run_scenario(scenario, out_dir, progress=False, hangs=hangs)
    return summary, read_events(Path(out_dir) / "events.jsonl")


def recovery_primitives(base: S.Scenario, reps: int, workdir: Path, steps: int, transfer_gbyte_s: float,
                        progress: Callable[[str], None], failures: list | None = None,
                        slot_compute_s: float = 0.0) -> dict[str, list[float]]:
    """Real runs of the local scenario's shape. Absorb runs (`reps`): a training worker is
    SIGKILLed and the hot spare takes over, a worker is spiked, another SIGSTOPped, and the
    last region lost (no spare left, the survivors take its slots). checkpoint_restart runs
    (one, two beyond 5 absorb runs): a worker is killed.

    From each episode: detection = detect - fault; after detection, the time to the first
    commit minus the redone step (the next generation's mean step) and the modelled state copy is the
    twin's pause: reform_s for the survivors-only episode (the rack loss), reform_s +
    spare_takeover_s for the spare's. restart_s = first commit after the restart - restart -
    one step."""
    trained = base.node_names[: base.training_nodes]
    # one fault at a time, each after the previous one's episode is over and past the run's
    # first steps (slower while the workers warm up), as a scenario's faults usually come: at
    # 60 steps, the kill at 8, the spike at 20 (over by ~40), the hang at 44, the rack at 52
    kill_at, hang_at = max(2, (2 * steps) // 15), max(4, (11 * steps) // 15)
    kill_target, hang_target = trained[1], trained[2]
    per_slot_copy_s = (base.checkpoint.weights_bytes + base.checkpoint.optimizer_bytes) / base.slot_count \
        / (transfer_gbyte_s * 1e9)
    spike_at, spike_s = max(3, steps // 3), 0.15
    spike_target = trained[3]  # holds one slot
    rack_at, rack = max(6, (13 * steps) // 15), base.regions[-1]
    sc = calibration_scenario(base, steps=steps, schedule=[
        {"at_step": kill_at, "class": "hardware_fault", "target": kill_target},
        {"at_step": spike_at, "class": "network_jitter", "target": spike_target,
         "spike_ms": spike_s * 1e3, "duration_s": 1.0},
        {"at_step": rack_at, "class": "partial_cluster_loss", "target": rack.name, "nodes": rack.nodes}])
    out: dict[str, list[float]] = {k: [] for k in ("detect_kill_s", "detect_hang_s", "reform_s",
                                                 "spare_takeover_s", "step_time_s", "restart_s",
                                                 "spike_rounds", "detect_rack_s", "spike_tail_s")}
    for rep in range(reps):
        progress(f"runtime run {rep + 1}/{reps}: {kill_target} killed (the spare takes over), "
                 f"a {spike_s * 1e3:.0f} ms spike on {spike_target}, {hang_target} hung, {rack.name} lost")
        summary, events = run_runtime(sc, workdir / f"absorb-{rep}", hangs=f"{hang_target}@{hang_at}",
                                      failures=failures)
        step = float(summary["step_time_s"])
        out["step_time_s"].append(step)
        pause = {}
        for fid, ep in _episode_times(events).items():
            t = ep["t"]
            if ep["class"] == "network_jitter":
                # the straggler's own excess per slot when it was found (it holds one slot)
                d = ep["detail"].get("detect", {})
                slow = next((e for e in events if e.kind == "detect" and e.detail.get("fault_id") == fid), None)
                if "per_slot_s" in d and "median_per_slot_s" in d and slow is not None:
                    # over the gate's own draw for that step (0-based index: the commit count - 1)
                    drawn = spike_s * S.spike_factor(sc.run.seed, spike_target, slow.step - 1)
                    out["spike_rounds"].append(max(0.0, (d["per_slot_s"] - d["median_per_slot_s"]) / drawn))
                    # the slow step's interval beyond the straggler's time to its collective
                    commits = {e.step: e.t for e in events if e.kind == "step"}
                    if slow.step in commits and slow.step - 1 in commits:
                        # the twin's spiked step is the target's compute (slot_compute_s, measured
                        # alone) + the delay + this tail: the tail takes in what computing among
                        # the others costs (their median time to the collective) beyond that
                        interval = commits[slow.step] - commits[slow.step - 1]
                        delay = d["per_slot_s"] - d["median_per_slot_s"]  # it holds one slot
                        out["spike_tail_s"].append(max(0.0, interval - delay - slot_compute_s))
                continue
            if not {"fault", "detect", "recover_end"} <= set(t):
                continue
            mode = "rack" if ep["class"] == "partial_cluster_loss" else ep["detail"]["fault"].get("mode")
            detect = t["detect"] - t["fault"]
            out[{"rack": "detect_rack_s", "hang": "detect_hang_s"}.get(mode, "detect_kill_s")].append(detect)
            # the twin adds one step at the new membership's mean pace for the redone step, so
            # that pace, measured on the generation after, is what is subtracted; the runtime's
            # own `redo_s` (last worker ready to the commit) came out shorter than the steps
            # after it (0.06-0.09 s against 0.09-0.11 s on 3 Dec), and taking it made the twin
            # add back more than it had subtracted
            end = ep["detail"]["recover_end"]
            redo = generation_pace(events, end["gen"]) if "gen" in end else None
            if redo is None:
                redo = end.get("redo_s", step)
            pause[mode] = t["recover_end"] - t["detect"] - redo - per_slot_copy_s
        # the rack loss leaves no spare: its pause is the survivors re-forming (the hang's is
        # longer: the hung worker is fenced then, and its exit competes with the re-formation)
        if "rack" in pause:
            out["reform_s"].append(max(0.0, pause["rack"]))
            if "kill" in pause:
                out["spare_takeover_s"].append(max(0.0, pause["kill"] - pause["rack"]))
    cr = calibration_scenario(base, steps=steps, schedule=[
        {"at_step": kill_at, "class": "hardware_fault", "target": kill_target}],
        overrides={"policy.kind": "checkpoint_restart"})
    restart_reps = 1 if reps <= 5 else 2  # each relaunches every worker: the slow runs
    for rep in range(restart_reps):
        progress(f"runtime run {rep + 1}/{restart_reps}: {kill_target} killed under checkpoint_restart")
        summary, events = run_runtime(cr, workdir / f"restart-{rep}", failures=failures)
        step = float(summary["step_time_s"])
        for fid, ep in _episode_times(events).items():
            if "restart" in ep["t"]:
                resumed = _first_commit_after(events, ep["t"]["restart"])
                if resumed is not None:
                    out["restart_s"].append(max(0.0, resumed - ep["t"]["restart"] - step))
    return out


def pace_by_workers(base: S.Scenario, workdir: Path, steps: int, counts: int,
                    progress: Callable[[str], None], failures: list | None = None,
                    rounds: int = 2) -> dict[int, float]:
    """Fault-free step time of the local scenario's shape with its first 1..R regions (the
    same slots and model): how the pace depends on the number of workers sharing this
    machine's cores, which independent-node models do not see. The machine's load drifts
    from one run to the next, so the counts are run in `rounds` rounds, in alternating order
    (7, 5, 5, 7, ...), and each count's figure is the median of its runs."""
    from planner.scenarios import plain
    scenarios: dict[int, S.Scenario] = {}
    for keep in range(len(base.regions), max(0, len(base.regions) - counts), -1):
        raw = plain(base)
        names = {r["name"] for r in raw["regions"][:keep]}
        raw["regions"] = raw["regions"][:keep]
        raw["links"] = [l for l in raw.get("links", []) if l["a"] in names and l["b"] in names]
        raw["faults"] = {}
        raw["run"]["steps"] = steps
        raw["run"]["seed"] = base.run.seed + 2000
        try:
            sc = S.from_dict(raw, base.source)
        except S.ScenarioError:
            continue
        scenarios[sc.training_nodes] = sc
    samples: dict[int, list[float]] = {w: [] for w in scenarios}
    order = list(scenarios)
    for r in range(rounds):
        for w in (order if r % 2 == 0 else order[::-1]):
            progress(f"fault-free pace run with {w} workers (round {r + 1}/{rounds})")
            _, events = run_runtime(scenarios[w], workdir / f"pace-{w}-{r}", failures=failures)
            samples[w].append(throughput_step_s(events))
    return {w: statistics.median(xs) for w, xs in samples.items() if xs}


# ----------------------------------------------------------------------------- calibrate

def throughput_step_s(events: Sequence[Any], warmup: int = 2) -> float:
    """A fault-free run's pace: its mean step, the commits past the first `warmup` over the
    time they took, checkpoints and the machine's hiccups included. The twin predicts a run's
    wall time from it, so it is the mean, not the median the runtime reports as its
    `step_time_s` (a few slow steps in every stretch put the mean 2-10 % above it here)."""
    commits = [(e.step, e.t) for e in events if e.kind == "step"]
    (s0, t0), (s1, t1) = commits[min(warmup, len(commits) - 2)], commits[-1]
    return (t1 - t0) / (s1 - s0)


def step_compute_s(scenario: S.Scenario, slot_compute_s: float, shared_host: bool) -> float:
    """The compute part of a fault-free step, as the twin models it: on a shared machine the
    slots' total spread evenly over the training workers (the cores do all of it, whoever holds
    which slot), else the busiest worker's slots."""
    per_worker = scenario.slot_count / scenario.training_nodes
    return (per_worker if shared_host else math.ceil(per_worker)) * slot_compute_s


def pace_split(step_time_s: float, compute_s: float, latency_s: float, gbyte_s: float,
               gradient_bytes: float) -> tuple[float, float]:
    """Split a measured fault-free step into compute, reduction and overhead: returns (the
    factor the reduction's latency is multiplied and its bandwidth divided by, the per-step
    overhead). The in-situ reduction is the step minus the compute; where the benchmarked
    reduction is slower it is scaled down to it, else the rest is overhead."""
    micro = latency_s + gradient_bytes / (gbyte_s * 1e9)
    in_situ = step_time_s - compute_s
    if micro <= 0:
        return 1.0, max(0.0, in_situ)
    return min(1.0, max(in_situ, 1e-6) / micro), max(0.0, in_situ - micro)


def refresh_pace(calibration: Mapping[str, Any], scenario: S.Scenario, step_time_s: float,
                 how: str, fewer: tuple[int, float] | None = None) -> dict[str, Any]:
    """The calibration with its load-dependent fault-free pace re-measured: the reduction's
    level and the per-step overhead re-split from `step_time_s` (every other primitive kept).
    `fewer` = (training workers, their fault-free step time) from a second run with fewer
    workers sharing the machine: `host_pace_per_worker` is then re-derived so that the twin's
    step for that membership is the one measured (`host_pace_from`)."""
    import copy
    cal = copy.deepcopy(dict(calibration))
    p = cal["primitives"]
    compute = step_compute_s(scenario, p["slot_compute_s"]["median"], shared_host="host_pace_per_worker" in p)
    lat = p["reduce_latency_s"].get("micro_benchmark", p["reduce_latency_s"])["median"]
    bw = p["reduce_gbyte_s"].get("micro_benchmark", p["reduce_gbyte_s"])["median"]
    scale, over = pace_split(step_time_s, compute, lat, bw, scenario.workload.gradient_bytes)

    def put(name: str, value: float, **record: Any) -> None:
        old = p.get(name, {})
        p[name] = {**old, "unit": old.get("unit", {**UNITS, **OPTIONAL}.get(name, "s")), "median": value,
                   "refreshed": {"how": how, "step_time_s": step_time_s, "calibrated_median": old.get("median"),
                                 **record}}
    for name, value in (("reduce_latency_s", lat * scale), ("reduce_gbyte_s", bw / scale),
                        ("step_overhead_s", over)):
        put(name, value)
    if fewer is not None and fewer[0] != scenario.training_nodes:
        put("host_pace_per_worker", host_pace_from(scenario, cal, *fewer),
            fewer_workers=fewer[0], fewer_step_time_s=fewer[1])
    return cal


def host_pace_from(scenario: S.Scenario, calibration: Mapping[str, Any], workers: int,
                   step_time_s: float) -> float:
    """The `host_pace_per_worker` at which the twin's fault-free step with `workers` training
    nodes (the run's slots placed over the first ones, as a fault-free run of them has it) is
    `step_time_s`, the full membership's step being the calibration's. The twin scales the
    whole step by 1 + slope x (holders - training nodes), so the slope is
    (measured / modelled unscaled - 1) / (workers - training nodes)."""
    import copy
    from twin.model import Simulation
    from twin.params import TwinParams
    cal = copy.deepcopy(dict(calibration))
    cal["primitives"]["host_pace_per_worker"] = {"median": 0.0}  # one host, the step unscaled
    modelled = Simulation(scenario, TwinParams.from_scenario(scenario, cal), scenario.run.seed).fault_free_step_s(workers)
    # fewer workers on a shared machine never make a step slower: a negative slope is load noise
    return max(0.0, (step_time_s / modelled - 1.0) / (workers - scenario.training_nodes))


def calibrate(*, quick: bool = False, base: S.Scenario | None = None, workdir: str | Path | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Measure every primitive; the object `calibration.json` holds."""
    from keel.cli import LOCAL_SCENARIO
    base = base or S.load(LOCAL_SCENARIO)
    reps = 3 if quick else 5
    # the recovery primitives come one sample per run: 5 runs give a median that two loaded
    # moments on a shared machine do not decide (one run gave reform_s 0.11 s against 0.02 s,
    # one spare_takeover_s 0.08 s against 0.01 s)
    run_reps = 5 if quick else 7
    run_steps = 60  # the local scenario's length: faults spaced as its schedule spaces them
    world = base.training_nodes
    started = time.perf_counter()

    def say(msg: str) -> None:
        if progress:
            print(f"calibrate: {msg} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)

    failures: list[dict[str, str]] = []  # runs that failed and were tried again, for the record
    tmp = tempfile.TemporaryDirectory(prefix="keel-calibrate-") if workdir is None else None
    work = Path(tmp.name if tmp else workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        say(f"micro-benchmarks in a gloo group of {world} processes ({reps} repetitions)")
        group = micro_group(base, world, reps)
        compute = [x for r in group for x in r["slot_compute_s"]]
        lat, bw, per_size = reduce_primitives(group)
        state_bytes = group[0]["state_bytes"]
        transfer = [state_bytes / max(max(r["state_transfer_s"][i] for r in group), 1e-9) / 1e9
                    for i in range(len(group[0]["state_transfer_s"]))]
        say("checkpoint snapshot, write and read")
        ckpt = checkpoint_throughput(base, reps, work)
        pace = pace_by_workers(base, work / "runs", PACE_STEPS, 2 if quick else 3, say, failures)
        rec = recovery_primitives(base, run_reps, work / "runs", run_steps, statistics.median(transfer), say,
                                  failures, slot_compute_s=statistics.median(compute))
    finally:
        if tmp is not None:
            tmp.cleanup()

    # The level of the reduction comes from the real runs, its shape from the micro-benchmark:
    # in situ, reduction = fault-free step time - the slowest worker's compute; the benchmark's
    # fit (latency + bytes / bandwidth) is scaled to it where it came out slower (a benchmark
    # among idle processes on a shared machine pays scheduling skew the training loop hides),
    # and where it came out faster the rest is per-step overhead.
    slot_compute = statistics.median(compute)
    lat_s, bw_s, overhead = [], [], []
    for st in ([pace[world]] if world in pace else rec["step_time_s"]):
        # the workers measured here share this machine (host_pace_per_worker below)
        scale, over = pace_split(st, step_compute_s(base, slot_compute, shared_host=len(pace) >= 2),
                                 statistics.median(lat), statistics.median(bw), base.workload.gradient_bytes)
        lat_s += [x * scale for x in lat]
        bw_s += [x / scale for x in bw]
        overhead.append(over)
    primitives = {
        "slot_compute_s": entry(compute, "s", how="one slot's forward+backward, real model and data, one process at a time"),
        "step_overhead_s": entry(overhead, "s", how="runtime fault-free step time - slots x slot_compute - reduction",
                                 step_time_s=pace.get(world)),
        "reduce_latency_s": entry(lat_s, "s", how=f"runtime.reduction over {world} gloo processes, affine fit, "
                                  "level scaled to the runs' in-situ reduction", world_size=world,
                                  micro_benchmark=entry(lat, "s"), median_s_per_gradient_bytes=per_size),
        "reduce_gbyte_s": entry(bw_s, "GB/s", how="float32 gradient bytes / the fit's bandwidth term (scaled alike)",
                                world_size=world, micro_benchmark=entry(bw, "GB/s")),
        "state_transfer_gbyte_s": entry(transfer, "GB/s", how="broadcast of weights + optimizer state over gloo",
                                        bytes=state_bytes, world_size=world),
        "ckpt_snapshot_gbyte_s": entry(ckpt["ckpt_snapshot_gbyte_s"], "GB/s", how="runtime.checkpoint.take_snapshot"),
        "ckpt_write_gbyte_s": entry(ckpt["ckpt_write_gbyte_s"], "GB/s", how="runtime.checkpoint.write_snapshot (fsynced)"),
        "ckpt_read_gbyte_s": entry(ckpt["ckpt_read_gbyte_s"], "GB/s", how="runtime.checkpoint.load_checkpoint (verified)"),
    }
    if rec["detect_rack_s"]:
        primitives["detect_rack_s"] = entry(rec["detect_rack_s"], "s",
                                            how="detect - fault of a rack loss (its workers SIGKILLed at once), runtime runs")
    if rec["spike_tail_s"]:
        primitives["spike_tail_s"] = entry(rec["spike_tail_s"], "s",
                                           how="a spiked worker's first slow step: commit interval - the gate's delay "
                                               "(its time to the collective - the others' median) - slot_compute_s, "
                                               "runtime runs")
    if rec["spike_rounds"]:
        primitives["spike_rounds"] = entry(rec["spike_rounds"], "rounds",
                                           how="a spiked worker's excess time per step over the median, / the "
                                               "gate's drawn delay for that step, when the runtime found it a straggler")
    for name, how in (("detect_kill_s", "detect - fault of a SIGKILLed worker, runtime runs"),
                      ("detect_hang_s", "detect - fault of a SIGSTOPped worker, runtime runs"),
                      ("reform_s", "rack loss (no spare left): detect to first commit - redo_s - state copy, runtime runs"),
                      ("spare_takeover_s", "killed worker, spare takes over: the same, minus the rack loss's"),
                      ("restart_s", "checkpoint_restart: restart to first commit - one step, runtime runs")):
        if rec[name]:
            primitives[name] = entry(rec[name], "s", how=how)
    missing = [p for p in PRIMITIVES if p not in primitives]
    counts = sorted(pace)
    slope = fit_affine([float(w) for w in counts], [pace[w] for w in counts]) if len(counts) >= 2 else None
    if slope is not None and slope[0] + slope[1] * world > 0:
        # the pace's change per worker relative to the fitted pace of the reference membership
        rel = max(0.0, slope[1] / (slope[0] + slope[1] * world))
        primitives["host_pace_per_worker"] = entry(
            [rel], "1/worker", how="fault-free runs with the first 1..R regions' workers: the affine fit's "
            "slope over its step time at the reference worker count", workers=counts,
            step_time_s=[pace[w] for w in counts])
    return {
        "format": "keel-calibration",
        "format_version": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "reference": {"scenario": base.run.name, "source": str(base.source), "training_workers": world,
                      "slots": base.slot_count, "model": base.to_dict()["model"],
                      "micro_batch": base.workload.micro_batch, "quick": quick,
                      "repetitions": reps, "runtime_runs": run_reps, "runtime_steps": run_steps,
                      "pace_steps": PACE_STEPS},
        "duration_s": round(time.perf_counter() - started, 2),
        "missing": missing,
        "runtime_failures": failures,
        # not a twin primitive (yet): on a machine whose cores the workers share, the pace
        # grows with the worker count; a host-sharing model would take it from here
        "pace": {"step_time_s_by_workers": {str(w): pace[w] for w in counts},
                 "fit": {"intercept_s": slope[0], "per_worker_s": slope[1]} if slope else None,
                 "cpus": machine().get("affinity_cpus")},
        "primitives": primitives,
    }


def write(calibration: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(calibration, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def table(calibration: Mapping[str, Any]) -> str:
    lines = [f"calibration on {calibration['machine']['hostname']} ({calibration['machine']['cpu_count']} CPUs, "
             f"torch {calibration['versions']['torch']}), {calibration['duration_s']} s"]
    for name in (*PRIMITIVES, *OPTIONAL):
        e = calibration["primitives"].get(name)
        if e is None:
            lines.append(f"  {name:<24} (not measured)")
            continue
        lines.append(f"  {name:<24} {e['median']:>12.6g} {e['unit']:<5} range [{e['spread'][0]:.4g}, "
                     f"{e['spread'][1]:.4g}]  n={e['n']}")
    return "\n".join(lines)
