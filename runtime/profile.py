"""`keel profile SCENARIO [--steps N] [--write FILE] [--json]`: what the twin needs to know about
the scenario's job, measured on this machine's device ($KEEL_DEVICE, default cpu).

It builds the job (runtime/job_run.py, after the contract check), trains it `--steps` steps on
one process (each step: every slot of the run computed here, the exact reduction of
runtime/reduction.py over them, the optimizer), and reports, each value with where it came
from: the per-slot compute time, the parameter count and bytes, the bytes the runtime's
reduction sends per step (its actual buffers, captured as they go to the collective), the
checkpoint's weights and optimizer bytes, and the snapshot, write and read rates of a real
checkpoint written to a temporary directory beside --write's file (or in the system's). With
`--write FILE` the scenario with those values in its `[workload]` and `[checkpoint]` tables is
written to FILE (the resolved scenario: every key, no comments; a job file entry relative to
the scenario made relative to FILE).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from keel.errors import InputError
from keel.rundir import print_json

GRADIENT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class WireCounter:
    """A stand-in for the reducer's collective on one process: it records each buffer it is
    handed (op, elements, bytes) and returns it as an all-reduce of one member would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, pg, t: torch.Tensor, op: str, should_abort) -> torch.Tensor:
        self.calls.append((op, t.numel(), t.numel() * t.element_size()))
        return t


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def profile(scenario, steps: int = 3, device: str | None = None, tmp_dir: str | Path | None = None) -> dict[str, Any]:
    """The measurements (module docstring), each {"value": ..., "source": ...}."""
    from runtime import checkpoint as ck
    from runtime.job_check import check_job
    from runtime.job_run import BoundJob, load_spec
    from runtime.reduction import Layout, SlotReducer, moment_bounds, reduction_format
    from runtime.waiting import Waiter

    device = device or os.environ.get("KEEL_DEVICE", "cpu")
    check_job(scenario)
    slots = scenario.slot_count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker computes
    try:
        with torch.random.fork_rng(devices=[]):
            job = BoundJob(load_spec(scenario), scenario, device)
            layout = Layout(job.sizes + (1,))
            counter = WireCounter()
            reducer = SlotReducer(layout, slots, device, Waiter(), collective=counter, fmt=reduction_format(scenario))
            job.slot_vector(0, 0)  # warm-up: lazy set-up is not the step's
            times, wire = [], []
            for step in range(steps):
                vectors = []
                for slot in range(slots):
                    t0 = time.perf_counter()
                    vectors.append(job.slot_vector(step, slot)[0])
                    if device != "cpu":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                moments = job.first_moments()
                counter.calls.clear()
                mean = reducer.reduce(None, vectors, lambda: False,
                                      bounds=None if moments is None else reducer.bounds(moment_bounds(moments)))
                if mean is None:
                    raise InputError(f"{scenario.source}: the job's step {step + 1} is non-finite; profile a job that trains")
                wire.append(list(counter.calls))
                job.apply(mean)
            t0 = time.perf_counter()
            snap = ck.take_snapshot(step=steps, model=job.model, optimizer=job.optimizer, rng=ck.capture_rng(),
                                    data_state=job.loader.state(steps), config_hash="0" * 64, config={},
                                    topology={}, extra=job.extra)
            snapshot_s = time.perf_counter() - t0
            with tempfile.TemporaryDirectory(prefix="keel-profile-", dir=tmp_dir) as tmp:
                t0 = time.perf_counter()
                path = ck.write_snapshot(tmp, snap, keep=1)
                write_s = time.perf_counter() - t0
                sizes = {p.name: p.stat().st_size for p in path.iterdir()}
                t0 = time.perf_counter()
                ck.load_checkpoint(path, log_warnings=False)
                read_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    total = sum(sizes.values())
    weights_bytes = sizes["weights.safetensors"]
    optimizer_bytes = sizes["optimizer_state.safetensors"] + sizes["optimizer_state.json"]
    dtypes = {p.dtype for p in job.params}
    here = f"measured here ({device}, one thread, {steps} steps of {slots} slots)"
    last = wire[-1]
    return {
        "job": {"value": job.spec.name, "source": "the scenario's [job] (none: the built-in GPT)"},
        "step_compute_s": {"value": statistics.median(times), "source": here + ": median of one slot's forward and backward"},
        "params": {"value": sum(job.sizes), "source": "the model's trainable parameters, counted"},
        "param_bytes": {"value": sum(p.numel() * p.element_size() for p in job.params), "source": "the same, in their dtype"},
        "gradient_dtype": {"value": GRADIENT_DTYPES.get(next(iter(dtypes)), "float32") if len(dtypes) == 1 else "float32",
                           "source": "the parameters' dtype"},
        "reduction_format": {"value": reducer.fmt, "source": "the scenario's reduction.format for its slots (keel.wire)"},
        "wire_bytes": {"value": sum(b for _, _, b in last), "source": here + ": the reduction's buffers of the last step, "
                       "as handed to the collective, per worker"},
        "wire_rounds": {"value": [[op, n, b] for op, n, b in last], "source": "(op, elements, bytes) of each collective"},
        "weights_bytes": {"value": weights_bytes, "source": "the checkpoint's weights.safetensors, written here"},
        "optimizer_bytes": {"value": optimizer_bytes, "source": "its optimizer_state files (with the job's further state)"},
        "checkpoint_bytes": {"value": total, "source": "every file of the checkpoint"},
        "snapshot_gbyte_s": {"value": _rate(total, snapshot_s), "source": here + ": the copy to the host at a step boundary"},
        "write_gbyte_s": {"value": _rate(total, write_s), "source": here + ": written and fsynced to " + str(tmp_dir or tempfile.gettempdir())},
        "read_gbyte_s": {"value": _rate(total, read_s), "source": here + ": read and verified (page cache warm)"},
    }


def scenario_values(measured: dict[str, Any]) -> dict[str, Any]:
    """The scenario keys the measurements set."""
    v = {k: m["value"] for k, m in measured.items()}
    return {"workload.step_compute_s": v["step_compute_s"], "workload.params": v["params"],
            "workload.gradient_dtype": v["gradient_dtype"], "checkpoint.weights_bytes": v["weights_bytes"],
            "checkpoint.optimizer_bytes": v["optimizer_bytes"], "checkpoint.snapshot_gbyte_s": v["snapshot_gbyte_s"],
            "checkpoint.write_gbyte_s": v["write_gbyte_s"], "checkpoint.read_gbyte_s": v["read_gbyte_s"]}


def main(args: argparse.Namespace) -> int:
    from keel.scenario import dumps, load
    scenario = load(args.scenario, args.overrides)
    write = Path(args.write) if args.write else None
    if write is not None and not write.parent.is_dir():
        raise InputError(f"--write {write}: no directory {write.parent}")
    measured = profile(scenario, steps=args.steps, tmp_dir=write.parent if write else None)
    if write is not None:
        values = scenario_values(measured)
        entry = scenario.job.entry
        target, _, factory = entry.rpartition(":")
        if (target.endswith(".py") or "/" in target) and not Path(target).is_absolute():  # still found from FILE
            from runtime.job_run import scenario_dir
            values["job.entry"] = f"{os.path.relpath(scenario_dir(scenario) / target, write.parent.resolve())}:{factory}"
        merged = scenario.with_overrides(values)
        write.write_text(f"# {scenario.source} with `keel profile`'s measurements ({measured['step_compute_s']['source']})\n"
                         + dumps(merged))
    if args.json:
        print_json(measured)
        return 0
    for key, m in measured.items():
        value = m["value"]
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        print(f"{key:18} {text:>16}  {m['source']}")
    if write is not None:
        print(f"wrote {write}", file=sys.stderr)
    return 0
