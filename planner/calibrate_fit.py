"""Calibration's fitting: pure functions from measured samples to the twin's primitives.

`keel calibrate` (planner/calibrate.py) runs the measurements; everything here takes their
samples (the runtime's micro-benchmark samples, the fault-free paces by worker count, the
event logs of the real runs) and returns figures, with no process, file or clock involved:
- `run_samples` / `restart_samples`: what one real run's event log says about detection,
  re-forming, take-over, spikes and restarts;
- `fit_calibration(samples, scenario)`: the `primitives` (each `keel.calibration.entry`),
  `missing` and `pace` parts of calibration.json;
- `refresh_pace`: a calibration with its load-dependent fault-free pace re-measured (validate).
"""
from __future__ import annotations

import copy
import math
import statistics
from typing import Any, Mapping, Sequence

from keel import scenario as S
from keel.calibration import PRIMITIVES, entry, unit
from keel.metrics import fault_episodes, mean_step_s_after_warmup


# ----------------------------------------------------------------------------- the micro-benchmarks

def fit_affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def reduce_primitives(group: list[dict]) -> tuple[list[float], list[float], dict]:
    """Per repetition: fit latency + bytes * s_per_byte over the sizes (the slowest rank's time
    is the collective's); returns (latencies, bandwidths GB/s, the medians per size)."""
    sizes = sorted(group[0]["reduce"], key=float)
    reps = len(group[0]["reduce"][sizes[0]])
    lat, bw = [], []
    for i in range(reps):
        xs = [float(s) for s in sizes]
        ys = [max(r["reduce"][s][i] for r in group) for s in sizes]
        a, b = fit_affine(xs, ys)
        lat.append(max(0.0, a))
        bw.append(1.0 / b / 1e9 if b > 0 else float("inf"))
    per_size = {str(s): statistics.median(max(r["reduce"][s][i] for r in group) for i in range(reps))
                for s in sizes}
    finite = [x for x in bw if x != float("inf")] or [1e3]
    return lat, finite, per_size


def transfer_gbyte_s(group: list[dict]) -> list[float]:
    """The state copy's GB/s per repetition (the slowest rank's time is the broadcast's)."""
    state_bytes = group[0]["state_bytes"]
    return [state_bytes / max(max(r["state_transfer_s"][i] for r in group), 1e-9) / 1e9
            for i in range(len(group[0]["state_transfer_s"]))]


def slot_compute(group: list[dict]) -> list[float]:
    return [x for r in group for x in r["slot_compute_s"]]


# ----------------------------------------------------------------------------- the fault-free pace

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


def generation_mean_step_s(events: Sequence[Any], gen: int) -> float | None:
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
    return mean_step_s_after_warmup(commits, warmup=0)


def host_pace_fit(pace: Mapping[int, float], world: int) -> tuple[tuple[float, float] | None, float | None]:
    """The affine fit of the fault-free pace over the worker counts (None under two counts),
    and its slope relative to the fitted pace at `world` workers (`host_pace_per_worker`;
    None where that pace is not positive)."""
    counts = sorted(pace)
    slope = fit_affine([float(w) for w in counts], [pace[w] for w in counts]) if len(counts) >= 2 else None
    if slope is None or slope[0] + slope[1] * world <= 0:
        return slope, None
    return slope, max(0.0, slope[1] / (slope[0] + slope[1] * world))


# ----------------------------------------------------------------------------- the real runs

RUN_KEYS = ("detect_kill_s", "detect_hang_s", "detect_rack_s", "reform_s", "spare_takeover_s",
            "spike_rounds", "spike_tail_s")


def _spike_samples(ep: Mapping[str, Any], events: Sequence[Any], seed: int, spike_target: str,
                   spike_s: float, slot_compute_s: float, out: dict[str, list[float]]) -> None:
    """A spike's episode: the straggler's own excess per slot when it was found (it holds one
    slot) over the gate's own draw for that step (`spike_rounds`), and the slow step's interval
    beyond the straggler's time to its collective (`spike_tail_s`)."""
    slow = ep["first_of"].get("detect")
    d = slow.detail if slow is not None else {}
    if "per_slot_s" not in d or "median_per_slot_s" not in d:
        return
    # the gate's draw for that step (0-based index: the commit count - 1)
    drawn = spike_s * S.spike_factor(seed, spike_target, slow.step - 1)
    delay = d["per_slot_s"] - d["median_per_slot_s"]  # it holds one slot
    out["spike_rounds"].append(max(0.0, delay / drawn))
    commits = {e.step: e.t for e in events if e.kind == "step"}
    if slow.step in commits and slow.step - 1 in commits:
        # the twin's spiked step is the target's compute (slot_compute_s, measured alone) + the
        # delay + this tail: the tail takes in what computing among the others costs (their
        # median time to the collective) beyond that
        interval = commits[slow.step] - commits[slow.step - 1]
        out["spike_tail_s"].append(max(0.0, interval - delay - slot_compute_s))


def run_samples(events: Sequence[Any], step_time_s: float, *, seed: int, spike_target: str, spike_s: float,
                per_slot_copy_s: float, slot_compute_s: float) -> dict[str, list[float]]:
    """What one absorb run's event log says (RUN_KEYS). Per episode: detection = detect -
    fault (by mode: a kill, a hang, a rack loss); after detection, the time to the first commit
    minus the redone step (the next generation's mean step) and the modelled state copy is the
    twin's pause: reform_s for the survivors-only episode (the rack loss), reform_s +
    spare_takeover_s for the spare's."""
    out: dict[str, list[float]] = {k: [] for k in RUN_KEYS}
    pause = {}
    for ep in fault_episodes(events):
        first = ep["first_of"]
        if ep["class"] == "network_jitter":
            _spike_samples(ep, events, seed, spike_target, spike_s, slot_compute_s, out)
            continue
        if not {"detect", "recover_end"} <= set(first):
            continue
        mode = "rack" if ep["class"] == "partial_cluster_loss" else first["fault"].detail.get("mode")
        out[{"rack": "detect_rack_s", "hang": "detect_hang_s"}.get(mode, "detect_kill_s")].append(
            first["detect"].t - ep["t"])
        # the twin adds one step at the new membership's mean pace for the redone step, so
        # that pace, measured on the generation after, is what is subtracted; the runtime's
        # own `redo_s` (last worker ready to the commit) came out shorter than the steps
        # after it (0.06-0.09 s against 0.09-0.11 s on 3 Dec), and taking it made the twin
        # add back more than it had subtracted
        end = first["recover_end"].detail
        redo = generation_mean_step_s(events, end["gen"]) if "gen" in end else None
        if redo is None:
            redo = end.get("redo_s", step_time_s)
        pause[mode] = first["recover_end"].t - first["detect"].t - redo - per_slot_copy_s
    # the rack loss leaves no spare: its pause is the survivors re-forming (the hang's is
    # longer: the hung worker is fenced then, and its exit competes with the re-formation)
    if "rack" in pause:
        out["reform_s"].append(max(0.0, pause["rack"]))
        if "kill" in pause:
            out["spare_takeover_s"].append(max(0.0, pause["kill"] - pause["rack"]))
    return out


def restart_samples(events: Sequence[Any], step_time_s: float) -> list[float]:
    """A checkpoint_restart run's restarts: the first commit after each restart - the restart
    - one step."""
    out = []
    for ep in fault_episodes(events):
        restart = ep["first_of"].get("restart")
        if restart is None:
            continue
        resumed = next((e.t for e in events if e.kind == "step" and e.t > restart.t), None)
        if resumed is not None:
            out.append(max(0.0, resumed - restart.t - step_time_s))
    return out


# ----------------------------------------------------------------------------- the fit

RECOVERY_HOW = (
    ("detect_kill_s", "detect - fault of a SIGKILLed worker, runtime runs"),
    ("detect_hang_s", "detect - fault of a SIGSTOPped worker, runtime runs"),
    ("reform_s", "rack loss (no spare left): detect to first commit - redo_s - state copy, runtime runs"),
    ("spare_takeover_s", "killed worker, spare takes over: the same, minus the rack loss's"),
    ("restart_s", "checkpoint_restart: restart to first commit - one step, runtime runs"),
)
OPTIONAL_HOW = (
    ("detect_rack_s", "detect - fault of a rack loss (its workers SIGKILLed at once), runtime runs"),
    ("spike_tail_s", "a spiked worker's first slow step: commit interval - the gate's delay (its time to the "
                     "collective - the others' median) - slot_compute_s, runtime runs"),
    ("spike_rounds", "a spiked worker's excess time per step over the median, / the gate's drawn delay for "
                     "that step, when the runtime found it a straggler"),
)


def _reduction_entries(group: list[dict], pace: Mapping[int, float], run_steps: Sequence[float],
                       scenario: S.Scenario) -> dict[str, dict]:
    """The level of the reduction comes from the real runs, its shape from the micro-benchmark:
    in situ, reduction = fault-free step time - the slowest worker's compute; the benchmark's
    fit (latency + bytes / bandwidth) is scaled to it where it came out slower (a benchmark
    among idle processes on a shared machine pays scheduling skew the training loop hides),
    and where it came out faster the rest is per-step overhead."""
    world = scenario.training_nodes
    lat, bw, per_size = reduce_primitives(group)
    slot = statistics.median(slot_compute(group))
    lat_s, bw_s, overhead = [], [], []
    for st in ([pace[world]] if world in pace else run_steps):
        # the workers measured here share this machine (host_pace_per_worker)
        scale, over = pace_split(st, step_compute_s(scenario, slot, shared_host=len(pace) >= 2),
                                 statistics.median(lat), statistics.median(bw), scenario.workload.gradient_bytes)
        lat_s += [x * scale for x in lat]
        bw_s += [x / scale for x in bw]
        overhead.append(over)
    return {
        "step_overhead_s": entry(overhead, "s", how="runtime fault-free step time - slots x slot_compute - reduction",
                                 step_time_s=pace.get(world)),
        "reduce_latency_s": entry(lat_s, "s", how=f"runtime.reduction over {world} gloo processes, affine fit, "
                                  "level scaled to the runs' in-situ reduction", world_size=world,
                                  micro_benchmark=entry(lat, "s"), median_s_per_gradient_bytes=per_size),
        "reduce_gbyte_s": entry(bw_s, "GB/s", how="float32 gradient bytes / the fit's bandwidth term (scaled alike)",
                                world_size=world, micro_benchmark=entry(bw, "GB/s")),
    }


def _micro_entries(micro: Mapping[str, Any], world: int) -> dict[str, dict]:
    group, ckpt = micro["group"], micro["checkpoint"]
    return {
        "slot_compute_s": entry(slot_compute(group), "s",
                                how="one slot's forward+backward, real model and data, one process at a time"),
        "state_transfer_gbyte_s": entry(transfer_gbyte_s(group), "GB/s",
                                        how="broadcast of weights + optimizer state over gloo",
                                        bytes=group[0]["state_bytes"], world_size=world),
        "ckpt_snapshot_gbyte_s": entry(ckpt["ckpt_snapshot_gbyte_s"], "GB/s", how="runtime.checkpoint.take_snapshot"),
        "ckpt_write_gbyte_s": entry(ckpt["ckpt_write_gbyte_s"], "GB/s", how="runtime.checkpoint.write_snapshot (fsynced)"),
        "ckpt_read_gbyte_s": entry(ckpt["ckpt_read_gbyte_s"], "GB/s", how="runtime.checkpoint.load_checkpoint (verified)"),
    }


def fit_calibration(samples: Mapping[str, Any], scenario: S.Scenario) -> dict[str, Any]:
    """The fitted part of calibration.json from the measured samples: {"micro": the runtime's
    `measure_primitives` samples, "pace": {training workers: fault-free step s}, "recovery":
    {name: [samples]} of the real runs (RUN_KEYS, "restart_s", and their "step_time_s")}.
    Returns {"primitives", "missing", "pace"} (the pace block without the machine's CPUs)."""
    world = scenario.training_nodes
    pace, rec = samples["pace"], samples["recovery"]
    primitives = {**_micro_entries(samples["micro"], world),
                  **_reduction_entries(samples["micro"]["group"], pace, rec["step_time_s"], scenario)}
    for name, how in (*OPTIONAL_HOW, *RECOVERY_HOW):
        if rec.get(name):
            primitives[name] = entry(rec[name], unit(name), how=how)
    counts = sorted(pace)
    slope, rel = host_pace_fit(pace, world)
    if rel is not None:
        # the pace's change per worker relative to the fitted pace of the reference membership
        primitives["host_pace_per_worker"] = entry(
            [rel], "1/worker", how="fault-free runs with the first 1..R regions' workers: the affine fit's "
            "slope over its step time at the reference worker count", workers=counts,
            step_time_s=[pace[w] for w in counts])
    return {
        "primitives": primitives,
        "missing": [p for p in PRIMITIVES if p not in primitives],
        # not a twin primitive (yet): on a machine whose cores the workers share, the pace
        # grows with the worker count; a host-sharing model would take it from here
        "pace": {"step_time_s_by_workers": {str(w): pace[w] for w in counts},
                 "fit": {"intercept_s": slope[0], "per_worker_s": slope[1]} if slope else None},
    }


# ----------------------------------------------------------------------------- re-measured pace

def refresh_pace(calibration: Mapping[str, Any], scenario: S.Scenario, step_time_s: float,
                 how: str, fewer: tuple[int, float] | None = None) -> dict[str, Any]:
    """The calibration with its load-dependent fault-free pace re-measured: the reduction's
    level and the per-step overhead re-split from `step_time_s` (every other primitive kept).
    `fewer` = (training workers, their fault-free step time) from a second run with fewer
    workers sharing the machine: `host_pace_per_worker` is then re-derived so that the twin's
    step for that membership is the one measured (`host_pace_from`)."""
    cal = copy.deepcopy(dict(calibration))
    p = cal["primitives"]
    compute = step_compute_s(scenario, p["slot_compute_s"]["median"], shared_host="host_pace_per_worker" in p)
    lat = p["reduce_latency_s"].get("micro_benchmark", p["reduce_latency_s"])["median"]
    bw = p["reduce_gbyte_s"].get("micro_benchmark", p["reduce_gbyte_s"])["median"]
    scale, over = pace_split(step_time_s, compute, lat, bw, scenario.workload.gradient_bytes)

    def put(name: str, value: float, **record: Any) -> None:
        old = p.get(name, {})
        p[name] = {**old, "unit": old.get("unit", unit(name)), "median": value,
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
    import twin
    cal = copy.deepcopy(dict(calibration))
    cal["primitives"]["host_pace_per_worker"] = {"median": 0.0}  # one host, the step unscaled
    modelled = twin.fault_free_step_s(scenario, cal, workers)
    # fewer workers on a shared machine never make a step slower: a negative slope is load noise
    return max(0.0, (step_time_s / modelled - 1.0) / (workers - scenario.training_nodes))
