"""The reduction's formats side by side (issue 24), a benchmark, not a test:

    .venv/bin/python bench/reduction.py [--steps 40] [--workers 4] [--slots 8] [--json]
        [--svg docs/figures/reduction.svg]

1. **Loopback**: `--workers` gloo processes on this machine train the built-in job (the scenario
   scenarios/local-8.toml's model, `--slots` slots spread evenly) for `--steps` steps with each
   reduction in turn, from the same initial weights: keel int64, keel block32, keel block16, a
   float32 all-reduce and a bf16 all-reduce of the workers' summed slot gradients. Per step:
   the bytes handed to the collectives (counted, per round) and the bytes each worker then sends
   in gloo's ring (x 2 (n - 1) / n), the reduction's wall time (median over steps, after 3), the
   mean loss of the last step, and each format's error against the float64 mean of the slots on
   the last step's gradients (relative L2).
2. **Emulated default cluster** (scenarios/multiregion-46.toml, 44 training nodes, 4 regions):
   the runtime's own hierarchical plan (runtime/emulation/hier.py) priced message by message by
   the link emulator (netem.py) at the bytes each format sends (keel.wire), no processes: the
   reduction's seconds per step, the fault-free step (step_compute_s + the reduction) and its
   ratio to the float32 all-reduce's; and the twin's fault-free step (`keel simulate` with the
   format) beside it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("int64", "block32", "block16", "float32", "bf16")


# ----------------------------------------------------------------------------- loopback

def _worker(rank: int, world: int, port: int, steps: int, slots: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from keel import scenario
    from runtime.data import Loader, ensure_dataset
    from runtime.model import build_model, build_optimizer, slot_loss
    from runtime.reduction import Layout, SlotReducer, moment_bounds
    from runtime.reduction_study import errors, ring_mean
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sc = scenario.load(ROOT / "scenarios" / "local-8.toml")
    loader = Loader(ensure_dataset(None, shards=sc.data.shards), sc.run.seed, sc.model.context, sc.workload.micro_batch)
    mine = [s for s in range(slots) if s % world == rank]
    pg = dist.distributed_c10d._get_default_group()
    results = {}
    for method in METHODS:
        model = build_model(sc.model, sc.run.seed)
        opt = build_optimizer(model, sc.model)
        params = list(model.parameters())
        layout = Layout(tuple(p.numel() for p in params) + (1,))
        sent: list[tuple[str, int, int]] = []

        def counting(pg, t, op, should_abort):
            sent.append((op, t.numel(), t.element_size()))
            ro = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            if t.dtype == torch.int16:  # gloo has none: the reducer's own point-to-point ring
                return SlotReducer._allreduce(red_p2p, pg, t, op, should_abort)
            dist.all_reduce(t, op=ro, group=pg)
            return t
        red = SlotReducer(layout, slots, fmt=method, collective=counting) if method in ("int64", "block32", "block16") else None
        red_p2p = SlotReducer(layout, slots, fmt=method) if method == "block16" else None
        times, step_bytes, loss = [], [], float("nan")
        for step in range(steps):
            vecs = []
            for s in mine:
                b = loader.batch(step, s)
                model.zero_grad(set_to_none=True)
                l = slot_loss(model, b.x, b.y, b.w)
                l.backward()
                vecs.append(torch.cat([p.grad.reshape(-1) for p in params] + [l.detach().reshape(1)]))
            sent.clear()
            dist.barrier()
            t0 = time.perf_counter()
            if red is not None:
                st = opt.state
                bounds = (red.bounds(moment_bounds([st[p]["exp_avg"] for p in params]))
                          if all(p in st for p in params) else None)
                mean = red.reduce(pg, vecs, lambda: False, bounds=bounds)
            else:
                dtype = torch.float32 if method == "float32" else torch.bfloat16
                buf = torch.stack(vecs).sum(0).to(dtype)
                sent.append(("sum", buf.numel(), buf.element_size()))
                dist.all_reduce(buf)
                mean = buf.float() / slots
            times.append(time.perf_counter() - t0)
            step_bytes.append(sum(n * size for _, n, size in sent))
            loss = float(mean[-1])
            for p, g in zip(params, mean.split(layout.sizes)):
                p.grad = g.view_as(p).clone()
            opt.step()
        # accuracy on the next step's gradients: every slot's vector, gathered on rank 0
        full = [torch.zeros(layout.total) for _ in range(slots)]
        for s in range(slots):
            v = torch.zeros(layout.total)
            if s in mine:
                b = loader.batch(steps, s)
                model.zero_grad(set_to_none=True)
                l = slot_loss(model, b.x, b.y, b.w)
                l.backward()
                v = torch.cat([p.grad.reshape(-1) for p in params] + [l.detach().reshape(1)])
            dist.all_reduce(v)  # only its holder's is non-zero
            full[s] = v
        err = None
        if rank == 0:
            from runtime.reduction import reduce_local
            exact = torch.stack([v.double() for v in full]).mean(0)
            got = (reduce_local(layout, [full], slots, None, method) if red is not None
                   else ring_mean(full, torch.float32 if method == "float32" else torch.bfloat16))
            err = errors(got, exact, layout)
        results[method] = {"bytes_per_step": statistics.median(step_bytes),
                           "sent_per_worker": statistics.median(step_bytes) * 2 * (world - 1) / world,
                           "params": layout.total - 1,
                           "reduce_ms": 1e3 * statistics.median(times[3:] or times),
                           "final_loss": loss, "error": err}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def loopback(steps: int, workers: int, slots: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"keel-bench-reduction-{os.getpid()}.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, workers, port, steps, slots, str(out))) for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"bench/reduction.py: a loopback worker failed: {[p.exitcode for p in procs]}")
    got = json.loads(out.read_text())
    out.unlink()
    return got


# ----------------------------------------------------------------------------- emulated cluster

def emulated() -> dict:
    from keel import hardware as H, scenario, wire
    from runtime.emulation import hier, netem
    out = {}
    for method in METHODS:
        fmt, dtype = (method, "bf16") if method in ("int64", "block32", "block16") else ("native", method)
        sc = scenario.load(ROOT / "scenarios" / "multiregion-46.toml",
                           [f"reduction.format={fmt}", f"workload.gradient_dtype={dtype}"])
        members = sc.node_names[: sc.training_nodes]
        groups = H.ring_members(sc, members)
        order = [n for g in groups for n in g]
        index = {n: i for i, n in enumerate(order)}
        length = 44_000
        pricer = netem.CollectivePricer(netem.LinkEmulator(sc), order)
        clocks = [0.0] * len(order)
        for i, (nbytes, exchange) in enumerate(wire.scenario_rounds(sc)):
            plan = hier.build_plan([[index[n] for n in g] for g in groups], length, exchange)
            pricer.bytes_per_element, pricer.key = nbytes / length, f"bench/r{i}"
            clocks = hier.clocks(plan, clocks, pricer)
        reduce_s = max(clocks)
        twin = _twin_step(sc)
        out[method] = {"bytes_per_step": wire.scenario_bytes(sc), "reduce_s": reduce_s,
                       "step_s": sc.workload.step_compute_s + reduce_s, "twin_step_s": twin}
    base = out["float32"]["step_s"]
    for v in out.values():
        v["step_vs_float32"] = v["step_s"] / base
    return out


def _twin_step(sc) -> float:
    """The twin's fault-free step time (`keel simulate`'s step_time_s)."""
    import twin
    return twin.simulate(sc).summary["step_time_s"]


# ----------------------------------------------------------------------------- report

def table(lb: dict, em: dict) -> str:
    f32 = lb["float32"]["bytes_per_step"]
    rows = ["| reduction | bytes / element | bytes / step (loopback) | vs float32 | sent per worker | "
            "reduce ms (loopback) | loss after N | rel. L2 error vs float64 mean | emulated reduction s | "
            "emulated step s | vs float32 | twin step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in METHODS:
        a, b = lb[m], em[m]
        rows.append(f"| {m} | {a['bytes_per_step'] / a['params']:.3f} | {a['bytes_per_step']:,.0f} | "
                    f"{a['bytes_per_step'] / f32:.3f}x | {a['sent_per_worker']:,.0f} | {a['reduce_ms']:.2f} | "
                    f"{a['final_loss']:.4f} | {a['error']['rel_l2']:.2e} | {b['reduce_s']:.3f} | {b['step_s']:.3f} | "
                    f"{b['step_vs_float32']:.3f}x | {b['twin_step_s']:.3f} |")
    return "\n".join(rows)


def plot(lb: dict, em: dict, path: str) -> None:
    """Three bar panels as a plain SVG: bytes per element, error of the mean (log), and the
    emulated step over float32's."""
    import math
    panels = [("bytes per gradient element per step", [lb[m]["bytes_per_step"] / lb[m]["params"] for m in METHODS],
               False, "#1f77b4"),
              ("rel. L2 error of the mean (log)", [lb[m]["error"]["rel_l2"] for m in METHODS], True, "#ff7f0e"),
              ("emulated multiregion-46 step / float32's", [em[m]["step_vs_float32"] for m in METHODS], False, "#2ca02c")]
    w, h, pad = 300, 220, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * w}" height="{h + 2 * pad}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    for k, (title, values, log, colour) in enumerate(panels):
        x0 = k * w + pad
        lo = min(values) / 3 if log else (0.9 if k == 2 else 0.0)
        hi = max(values) * (3 if log else 1.05)
        scale = (lambda v: (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))) if log else \
            (lambda v: (v - lo) / (hi - lo))
        out.append(f'<text x="{x0}" y="{pad - 20}" font-weight="bold">{title}</text>')
        out.append(f'<line x1="{x0}" y1="{pad + h}" x2="{x0 + w - pad - 10}" y2="{pad + h}" stroke="black"/>')
        bw = (w - pad - 10) / len(values)
        for i, (m, v) in enumerate(zip(METHODS, values)):
            bh = max(1.0, h * scale(v))
            x = x0 + i * bw + 4
            out.append(f'<rect x="{x:.1f}" y="{pad + h - bh:.1f}" width="{bw - 8:.1f}" height="{bh:.1f}" fill="{colour}"/>')
            out.append(f'<text x="{x:.1f}" y="{pad + h - bh - 3:.1f}">{v:.3g}</text>')
            out.append(f'<text x="{x:.1f}" y="{pad + h + 14}">{m}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--svg", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    em = emulated()
    lb = loopback(a.steps, a.workers, a.slots)
    if a.svg:
        plot(lb, em, a.svg)
    if a.json:
        print(json.dumps({"loopback": lb, "emulated": em}))
    else:
        print(table(lb, em))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
