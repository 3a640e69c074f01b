"""`keel calibrate`: measure, on this machine, every primitive the twin needs to model the
runtime (keel/calibration.py lists them, twin/params.py says what each is), with the machine and
versions they were measured on. This module runs the measurements; `planner.calibrate_fit`
fits them (pure functions); `keel.calibration` reads and writes the file.

Nothing is typed in by hand. Three kinds of measurement, each repeated:
- the runtime's own micro-benchmarks (`runtime.api.measure_primitives`): in a gloo group of as
  many processes as the local scenario has training workers, one slot's forward and backward,
  the deterministic slot reduction at several gradient sizes (fitted as latency + bytes /
  bandwidth) and a peer state copy; and checkpoint snapshot, write and read throughput;
- fault-free runs through `runtime.api.run_scenario` with the first 1..R regions' workers:
  the pace and how it grows with the workers sharing this machine;
- short real runs of the local scenario's shape with their own fault schedule (a killed worker
  taken over by the hot spare, a hung worker, a spiked worker, a lost region, a killed worker
  under `checkpoint_restart`), read from their event logs: detection, re-forming, take-over
  and restart times, and the fault-free step time (whose part beyond compute and reduction is
  `step_overhead_s`).
The runs use another seed and schedule than any scenario they later validate.
"""
from __future__ import annotations

import datetime as _dt
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
from keel.calibration import FORMAT, FORMAT_VERSION, table, write  # noqa: F401 (table, write: planner/cli.py)
from keel.errors import RunFailed
from keel.metrics import mean_step_s_after_warmup
from planner.calibrate_fit import (RUN_KEYS, fit_calibration, restart_samples, run_samples, slot_compute,
                                   transfer_gbyte_s)

PACE_STEPS = 30  # a fault-free pace run's length (calibrate's and validate's)
RUN_STEPS = 60  # a recovery run's length, the local scenario's: faults spaced as its schedule spaces them


def repetitions(quick: bool) -> tuple[int, int]:
    """(micro-benchmark repetitions, recovery runs). The recovery primitives come one sample
    per run: 5 runs give a median that two loaded moments on a shared machine do not decide
    (one run gave reform_s 0.11 s against 0.02 s, one spare_takeover_s 0.08 s against 0.01 s)."""
    return (3, 5) if quick else (5, 7)


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
        from runtime.api import commit_sha
        out["commit_sha"] = commit_sha()
    except Exception:  # calibration must not fail on a missing git
        out["commit_sha"] = "unknown"
    return out


# ----------------------------------------------------------------------------- real runtime runs

def calibration_scenario(base: S.Scenario, *, steps: int, schedule: Sequence[Mapping[str, Any]],
                         overrides: Mapping[str, Any] | None = None) -> S.Scenario:
    """The local scenario's shape with a calibration seed and schedule of its own."""
    return base.with_overrides({
        "run.name": f"{base.run.name}-calibration", "run.seed": base.run.seed + 1000, "run.steps": steps,
        "faults": {"schedule": [dict(e) for e in schedule]},
        "checkpoint.interval_steps": max(1, steps // 3), **(overrides or {})})


def run_runtime(scenario: S.Scenario, out_dir: Path, hangs: str | None = None,
                failures: list[dict[str, str]] | None = None) -> tuple[dict, list]:
    """One real run; a run that fails is recorded and tried once more in a fresh directory
    (a calibration measures primitives, one flaky run must not void it; the record says so)."""
    from keel.rundir import read_events
    from runtime.api import run_scenario
    try:
        summary = run_scenario(scenario, out_dir, progress=False, hangs=hangs)
    except RunFailed as e:
        if failures is not None:
            failures.append({"run": str(out_dir), "error": str(e)})
        print(f"calibrate: runtime run {out_dir} failed ({e}); trying it once more", file=sys.stderr)
        out_dir = Path(f"{out_dir}-retry")
        summary = run_scenario(scenario, out_dir, progress=False, hangs=hangs)
    return summary, read_events(out_dir)


def recovery_primitives(base: S.Scenario, reps: int, workdir: Path, steps: int, transfer_gbyte_s: float,
                        progress: Callable[[str], None], failures: list | None = None,
                        slot_compute_s: float = 0.0) -> dict[str, list[float]]:
    """Real runs of the local scenario's shape, their samples (`calibrate_fit.run_samples`,
    `restart_samples`) pooled. Absorb runs (`reps`): a training worker is SIGKILLed and the
    hot spare takes over, a worker is spiked, another SIGSTOPped, and the last region lost (no
    spare left, the survivors take its slots). checkpoint_restart runs (one, two beyond 5
    absorb runs): a worker is killed."""
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
    out: dict[str, list[float]] = {k: [] for k in (*RUN_KEYS, "step_time_s", "restart_s")}
    for rep in range(reps):
        progress(f"runtime run {rep + 1}/{reps}: {kill_target} killed (the spare takes over), "
                 f"a {spike_s * 1e3:.0f} ms spike on {spike_target}, {hang_target} hung, {rack.name} lost")
        summary, events = run_runtime(sc, workdir / f"absorb-{rep}", hangs=f"{hang_target}@{hang_at}",
                                      failures=failures)
        step = float(summary["step_time_s"])
        out["step_time_s"].append(step)
        for name, xs in run_samples(events, step, seed=sc.run.seed, spike_target=spike_target, spike_s=spike_s,
                                    per_slot_copy_s=per_slot_copy_s, slot_compute_s=slot_compute_s).items():
            out[name] += xs
    cr = calibration_scenario(base, steps=steps, schedule=[
        {"at_step": kill_at, "class": "hardware_fault", "target": kill_target}],
        overrides={"policy.kind": "checkpoint_restart"})
    restart_reps = 1 if reps <= 5 else 2  # each relaunches every worker: the slow runs
    for rep in range(restart_reps):
        progress(f"runtime run {rep + 1}/{restart_reps}: {kill_target} killed under checkpoint_restart")
        summary, events = run_runtime(cr, workdir / f"restart-{rep}", failures=failures)
        out["restart_s"] += restart_samples(events, float(summary["step_time_s"]))
    return out


def pace_scenarios(base: S.Scenario, steps: int, counts: int) -> dict[int, S.Scenario]:
    """Fault-free variants of the local scenario's shape with its first R, R-1, ... regions
    (`counts` of them, those the schema accepts), by training workers."""
    raw = base.plain()
    scenarios: dict[int, S.Scenario] = {}
    for keep in range(len(base.regions), max(0, len(base.regions) - counts), -1):
        names = {r["name"] for r in raw["regions"][:keep]}
        try:
            sc = base.with_overrides({
                "regions": raw["regions"][:keep],
                "links": [l for l in raw.get("links", []) if l["a"] in names and l["b"] in names],
                "faults": {}, "run.steps": steps, "run.seed": base.run.seed + 2000})
        except S.ScenarioError:
            continue
        scenarios[sc.training_nodes] = sc
    return scenarios


def pace_by_workers(base: S.Scenario, workdir: Path, steps: int, counts: int,
                    progress: Callable[[str], None], failures: list | None = None,
                    rounds: int = 2) -> dict[int, float]:
    """Fault-free step time of the local scenario's shape with its first 1..R regions (the
    same slots and model): how the pace depends on the number of workers sharing this
    machine's cores, which independent-node models do not see. The machine's load drifts
    from one run to the next, so the counts are run in `rounds` rounds, in alternating order
    (7, 5, 5, 7, ...), and each count's figure is the median of its runs
    (`keel.metrics.mean_step_s_after_warmup` each)."""
    scenarios = pace_scenarios(base, steps, counts)
    samples: dict[int, list[float]] = {w: [] for w in scenarios}
    order = list(scenarios)
    for r in range(rounds):
        for w in (order if r % 2 == 0 else order[::-1]):
            progress(f"fault-free pace run with {w} workers (round {r + 1}/{rounds})")
            _, events = run_runtime(scenarios[w], workdir / f"pace-{w}-{r}", failures=failures)
            samples[w].append(mean_step_s_after_warmup(events))
    return {w: statistics.median(xs) for w, xs in samples.items() if xs}


# ----------------------------------------------------------------------------- calibrate

def measure(base: S.Scenario, work: Path, quick: bool, say: Callable[[str], None],
            failures: list[dict[str, str]]) -> dict[str, Any]:
    """Every measurement, in order: the runtime's micro-benchmarks, the pace runs, the
    recovery runs. Returns the samples `fit_calibration` takes."""
    from runtime.api import measure_primitives
    reps, run_reps = repetitions(quick)
    micro = measure_primitives(base, reps, work, world=base.training_nodes, progress=say)
    pace = pace_by_workers(base, work / "runs", PACE_STEPS, 2 if quick else 3, say, failures)
    slot = statistics.median(slot_compute(micro["group"]))
    transfer = statistics.median(transfer_gbyte_s(micro["group"]))
    rec = recovery_primitives(base, run_reps, work / "runs", RUN_STEPS, transfer, say, failures, slot_compute_s=slot)
    return {"micro": micro, "pace": pace, "recovery": rec}


def calibrate(*, quick: bool = False, base: S.Scenario | None = None, workdir: str | Path | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Measure every primitive and fit them (`calibrate_fit.fit_calibration`); the object
    `calibration.json` holds."""
    from keel.paths import LOCAL_SCENARIO
    base = base or S.load(LOCAL_SCENARIO)
    started = time.perf_counter()

    def say(msg: str) -> None:
        if progress:
            print(f"calibrate: {msg} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)

    failures: list[dict[str, str]] = []  # runs that failed and were tried again, for the record
    tmp = tempfile.TemporaryDirectory(prefix="keel-calibrate-") if workdir is None else None
    try:
        samples = measure(base, Path(tmp.name if tmp else workdir), quick, say, failures)
    finally:
        if tmp is not None:
            tmp.cleanup()
    fitted = fit_calibration(samples, base)
    info = machine()
    reps, run_reps = repetitions(quick)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "versions": versions(),
        "reference": {"scenario": base.run.name, "source": str(base.source), "training_workers": base.training_nodes,
                      "slots": base.slot_count, "model": base.to_dict()["model"],
                      "micro_batch": base.workload.micro_batch, "quick": quick,
                      "repetitions": reps, "runtime_runs": run_reps, "runtime_steps": RUN_STEPS,
                      "pace_steps": PACE_STEPS},
        "duration_s": round(time.perf_counter() - started, 2),
        "missing": fitted["missing"],
        "runtime_failures": failures,
        "pace": {**fitted["pace"], "cpus": info.get("affinity_cpus")},
        "primitives": fitted["primitives"],
    }
