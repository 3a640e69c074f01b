"""Where a fault-free step's CPU goes: keel's runtime against plain DDP (bench/peers.py's
baseline: the same model, data, 4 workers on gloo), by process role, from /proc.

Each job runs alone, the two alternating for `--rounds` rounds. Once a job has committed
`--warmup` steps, every process of its tree is sampled (utime + stime from /proc/PID/stat),
and again `--steps` commits later: CPU milliseconds per committed step for each role (keel:
supervisor, coordinator, workers; DDP: torchrun's agent, workers) and wall milliseconds per
step. On a machine with fewer cores than workers the step is CPU-bound, so a job's wall time
per step follows its total CPU per step over the cores.

    .venv/bin/python bench/step_cpu.py [--rounds 3] [--steps 400] [--checkpoint-every 0] [--scenario S] [--json]

`--checkpoint-every N` gives keel a checkpoint every N steps (its own format, bench/peers-4.toml's
sync mode); 0 (the default) none, as the DDP baseline has none.
"""
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _proc(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, CPU ticks, command line) of `pid`; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    f = raw[raw.rindex(b")") + 2:].split()
    return int(f[1]), int(f[11]) + int(f[12]), cmd


def role(pid: int, procs: dict[int, tuple[int, int, str]]) -> str:
    ppid, _, cmd = procs[pid]
    if "torch.distributed.run" in cmd:  # before the workers: its command line names their script
        return "torchrun agent"
    if "peers_train.py" in cmd:
        return "workers"
    if "runtime.coordinator" in cmd:
        return "coordinator"  # the running one and its standby (which idles)
    if "forkserver" in cmd and "forkserver" in procs.get(ppid, (0, 0, ""))[2]:
        return "workers"  # keel's workers: children of its fork server
    if " keel.cli run" in cmd or "keel run" in cmd:
        return "supervisor"
    return "other"  # the fork server, multiprocessing's resource tracker


def sample(job: peers.Job) -> tuple[float, int, dict[int, tuple[int, int, str]]]:
    procs = {pid: p for pid in job.tree() if (p := _proc(pid)) is not None}
    return time.monotonic(), job.committed(), procs


def measure(tool: str, cfg: peers.Config, work: Path, warmup: int, steps: int) -> dict:
    """One job of `tool` ("ddp" or "keel"): wall and CPU ms per step, by role, over `steps`
    commits after `warmup`."""
    job = peers.launch(tool, cfg, work)
    try:
        deadline = time.monotonic() + peers.RUN_TIMEOUT_S + steps

        def reach(target: int) -> None:
            while job.committed() < target:
                if time.monotonic() > deadline or any(p.poll() is not None for p in job.roots):
                    raise RuntimeError(f"{tool} ({work}): stopped before step {target}; see the logs there")
                time.sleep(0.02)
        reach(warmup)
        t0, n0, before = sample(job)
        reach(n0 + steps)  # n0 may be past warmup by a step or two: `steps` commits from there
        t1, n1, after = sample(job)
    finally:
        job.close()
        peers.reap(work)
    n = n1 - n0
    roles = {pid: role(pid, after) for pid in after}
    cpu: dict[str, float] = {}
    for pid, (_, ticks, _) in after.items():
        cpu[roles[pid]] = cpu.get(roles[pid], 0.0) + (ticks - before.get(pid, (0, 0, ""))[1]) * TICK_MS / n
    workers = sum(1 for r in roles.values() if r == "workers")
    return {"wall_ms": 1000 * (t1 - t0) / n, "cpu_ms": cpu, "workers": workers, "steps": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--scenario", default=peers.Config.scenario,
                   help="keel's scenario, whose job both train (bench/peers-4-llama.toml: the transformers example)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    cfg = peers.Config(checkpoint_every=a.checkpoint_every or peers.LONG_RUN, scenario=str(Path(a.scenario).resolve()))
    runs: dict[str, list[dict]] = {"ddp": [], "keel": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for tool in runs:
                m = measure(tool, cfg, Path(d) / f"{tool}-{r}", a.warmup, a.steps)
                runs[tool].append(m)
                print(f"round {r + 1}: {tool} {m['wall_ms']:.1f} ms/step, "
                      f"{sum(m['cpu_ms'].values()):.1f} ms CPU/step", file=sys.stderr, flush=True)
    med = {t: {"wall_ms": statistics.median(m["wall_ms"] for m in ms),
               "cpu_ms": {k: statistics.median(m["cpu_ms"].get(k, 0.0) for m in ms)
                          for k in dict.fromkeys(k for m in ms for k in m["cpu_ms"])},
               "workers": ms[0]["workers"]} for t, ms in runs.items()}
    for t in med.values():
        t["cpu_total_ms"] = sum(t["cpu_ms"].values())
        t["cpu_per_worker_ms"] = t["cpu_ms"].get("workers", 0.0) / max(1, t["workers"])
    ratios = {k: med["keel"][k] / med["ddp"][k] for k in ("wall_ms", "cpu_total_ms", "cpu_per_worker_ms")}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cores": os.cpu_count(), "scenario": a.scenario, "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
           "checkpoint_every": a.checkpoint_every, "median": med, "keel_over_ddp": ratios, "runs": runs}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{out['date']}, {out['cores']} CPU cores, {med['ddp']['workers']} DDP and {med['keel']['workers']} keel "
          f"workers, {a.steps} steps after {a.warmup}, median of {a.rounds} rounds (alternating), keel checkpoints: "
          f"{'every %d steps' % a.checkpoint_every if a.checkpoint_every else 'none'}")
    print(f"{'ms per step':32}{'DDP':>10}{'keel':>10}{'keel / DDP':>12}")
    print(f"{'wall':32}{med['ddp']['wall_ms']:10.2f}{med['keel']['wall_ms']:10.2f}{ratios['wall_ms']:12.3f}")
    print(f"{'CPU, all processes':32}{med['ddp']['cpu_total_ms']:10.2f}{med['keel']['cpu_total_ms']:10.2f}"
          f"{ratios['cpu_total_ms']:12.3f}")
    print(f"{'CPU, one worker (mean)':32}{med['ddp']['cpu_per_worker_ms']:10.2f}"
          f"{med['keel']['cpu_per_worker_ms']:10.2f}{ratios['cpu_per_worker_ms']:12.3f}")
    for k in ("torchrun agent", "supervisor", "coordinator", "other"):
        d, k_ = med["ddp"]["cpu_ms"].get(k), med["keel"]["cpu_ms"].get(k)
        if d is not None or k_ is not None:
            print(f"{'CPU, ' + k:32}{'-' if d is None else f'{d:.2f}':>10}{'-' if k_ is None else f'{k_:.2f}':>10}")


if __name__ == "__main__":
    main()
