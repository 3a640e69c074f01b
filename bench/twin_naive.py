"""The twin's speed against the straightforward SimPy model: one process per node and one event
per node and step (each node draws its compute, the step ends when the slowest is done, then
the reduction), on the same scenario, with the same numbers taken from the twin's own cost
model (per-node compute, jitter, reduction, detection, recovery and checkpoint pauses), so
only the event structure differs. The scenario is bench/twin_speed.py's 46-node cluster scaled
to 46, 512 and 2,048 nodes, with hardware faults only (the naive model has no other class; a
node's MTBF of 200 h instead of 5,000 h, so each horizon sees a few)
and over as many steps as the naive model simulates in a few seconds; both simulate the same
horizon. Reported: wall seconds of each, the ratio, and their goodput and fault counts.

    .venv/bin/python bench/twin_naive.py [--seeds 3] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import simpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import twin  # noqa: E402
from bench.twin_speed import scaled  # noqa: E402
from twin.model import Simulation  # noqa: E402
from twin.params import TwinParams  # noqa: E402

# (nodes, steps): about 300k node-steps each, a few seconds of the naive model
CASES = [(46, 4000), (512, 300), (2048, 75)]
MTBF_NODE_HOURS = 200.0  # a node fails every 200 h (the scenario: 5,000 h), so each horizon sees a few faults


def scenario_for(nodes: int, steps: int, mtbf_node_hours: float = MTBF_NODE_HOURS):
    sc = scaled(nodes, 1.0)
    f = sc.faults
    faults = dataclasses.replace(
        f, hardware_fault=dataclasses.replace(f.hardware_fault, mtbf_node_hours=mtbf_node_hours), network_jitter=dataclasses.replace(f.network_jitter, per_day=0.0),
        partial_cluster_loss=dataclasses.replace(f.partial_cluster_loss, per_day=0.0),
        data_shard_skew=dataclasses.replace(f.data_shard_skew, per_day=0.0), schedule=())
    return dataclasses.replace(sc, faults=faults, run=dataclasses.replace(sc.run, steps=steps))


def naive(sc, seed: int) -> dict:
    """One process per node; a step is every node's compute (one timeout each), then the
    reduction; a node's death loses the step in flight, waits out detection and recovery
    (a spare takes its slot, or the fastest survivor), and the step is redone."""
    sim = Simulation(sc, TwinParams.from_scenario(sc), seed)  # only for its cost figures
    p, shape = sim.params, sim.cost.current_shape()
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    compute = [base for n, base, _ in shape.groups for _ in range(n)]  # per training node
    offset = [off for n, _, off in shape.groups for _ in range(n)]
    slots = [1] * len(compute)
    spares = sc.policy.hot_spares
    total_nodes = len(compute) + spares
    spare_copy_s = sim.cost.transfer_s([(sim.cluster.spare_nodes(1)[0].name, 1)]) if spares else 0.0
    ckpt_pause_s = sim.cost.share_s(p.ckpt_snapshot_gbyte_s if sc.checkpoint.mode == "async" else p.ckpt_write_gbyte_s)
    mtbf = sc.faults.hardware_fault.mtbf_node_hours
    rate = total_nodes / (mtbf * 3600.0) if mtbf > 0 else 0.0
    state = {"committed": 0, "faults": 0, "down": set(), "spares": spares, "moved": {}}
    trainer_box = {}

    def node(i: int, start: simpy.Event, done: list):
        yield start
        t = compute[i] * slots[i] * max(1.0 + shape.compute_jitter * rng.standard_normal(), 0.0) + offset[i]
        yield env.timeout(t)
        done[0] += 1
        if done[0] == done[1] and not done[2].triggered:
            done[2].succeed()

    def trainer():
        interval = sc.checkpoint.interval_steps
        while state["committed"] < sc.run.steps:
            live = [i for i in range(len(compute)) if i not in state["down"]]
            start, finished = env.event(), env.event()
            done = [0, len(live), finished]
            for i in live:
                env.process(node(i, start, done))
            start.succeed()
            try:
                yield finished
                noise = max(shape.link_jitter_s * rng.standard_normal(), -shape.latency_s)
                yield env.timeout(max(shape.fixed_s + noise, 0.0))  # the noise may undercut only the latency inside the offset
            except simpy.Interrupt as fault:
                victim = fault.cause
                yield env.timeout(p.detect_kill_s + sc.policy.heartbeat_s * (0.5 - rng.random()))
                pause = p.reform_s
                if state["spares"] > 0:  # the spare takes the slot (in the victim's place): it gets the state
                    state["spares"] -= 1
                    state["down"].discard(victim)
                    pause += p.spare_takeover_s + spare_copy_s
                else:  # the fastest finisher takes it, until the victim is repaired
                    fastest = min((i for i in range(len(compute)) if i not in state["down"]),
                                  key=lambda i: compute[i] * (slots[i] + 1))
                    slots[fastest] += slots[victim]
                    state["moved"][victim] = fastest
                yield env.timeout(pause)
                continue
            state["committed"] += 1
            if state["committed"] % interval == 0 and state["committed"] < sc.run.steps:
                yield env.timeout(ckpt_pause_s)

    def repair(victim: int):
        yield env.timeout(sc.faults.hardware_fault.repair_hours * 3600.0)
        if victim in state["moved"]:  # it takes its slot back from the node carrying two (as the twin re-slots)
            slots[state["moved"].pop(victim)] -= 1
            state["down"].discard(victim)
        else:  # a spare had taken its place: it rejoins as a spare
            state["spares"] += 1

    def faults():
        while True:
            yield env.timeout(rng.exponential(1.0 / rate))
            victim = int(rng.integers(total_nodes))
            if victim >= len(compute) or victim in state["down"]:
                continue  # a spare, or a node already down: nothing stops
            state["faults"] += 1
            state["down"].add(victim)
            env.process(repair(victim))
            if trainer_box["p"].is_alive:
                trainer_box["p"].interrupt(victim)

    t0 = time.perf_counter()
    trainer_box["p"] = env.process(trainer())
    if rate > 0:
        env.process(faults())
    env.run(until=trainer_box["p"])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "sim_s": env.now, "faults": state["faults"],
            "goodput": sc.run.steps * sim.healthy_step_s / env.now}


def keel_twin(sc, seed: int) -> dict:
    t0 = time.perf_counter()
    s = twin.simulate(sc, seed=seed).summary
    return {"wall_s": time.perf_counter() - t0, "sim_s": s["wall_s"], "faults": len(s["faults"]), "goodput": s["goodput"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from keel.progress import progress_bar
    rows = []
    with progress_bar(total=len(CASES) * args.seeds, desc="twin vs naive", unit="run") as bar:
        for nodes, steps in CASES:
            sc = scenario_for(nodes, steps)
            k, n = [], []
            for seed in range(args.seeds):  # interleaved
                n.append(naive(sc, seed))
                k.append(keel_twin(sc, seed))
                bar.update()
            ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(n, k)]
            clean = scenario_for(nodes, steps, 0.0)  # no faults: the same fault-free pace?
            clean_twin, clean_naive = keel_twin(clean, 0), naive(clean, 0)
            rows.append({
                "nodes": nodes, "steps": steps, "simulated_h": statistics.mean(x["sim_s"] for x in k) / 3600,
                "twin_wall_s": statistics.median(x["wall_s"] for x in k),
                "naive_wall_s": statistics.median(x["wall_s"] for x in n),
                "naive_over_twin": statistics.median(ratios), "naive_over_twin_range": [min(ratios), max(ratios)],
                "twin_goodput": statistics.mean(x["goodput"] for x in k),
                "naive_goodput": statistics.mean(x["goodput"] for x in n),
                "twin_faults": sum(x["faults"] for x in k), "naive_faults": sum(x["faults"] for x in n),
                "fault_free_step_s_twin": clean_twin["sim_s"] / steps, "fault_free_step_s_naive": clean_naive["sim_s"] / steps,
                "seeds": args.seeds})
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    print(f"twin vs the naive SimPy model (one process per node, one event per node and step); hardware "
          f"faults only; median of {args.seeds} seeds, interleaved")
    print(f"{'nodes':>6}{'steps':>7}{'sim h':>7}{'twin s':>9}{'naive s':>9}{'naive/twin':>18}"
          f"{'goodput twin':>14}{'naive':>7}{'faults twin':>13}{'naive':>7}")
    for r in rows:
        print(f"{r['nodes']:>6}{r['steps']:>7}{r['simulated_h']:>7.1f}{r['twin_wall_s']:>9.3f}{r['naive_wall_s']:>9.2f}"
              f"{r['naive_over_twin']:>8.0f} [{r['naive_over_twin_range'][0]:.0f}-{r['naive_over_twin_range'][1]:.0f}]"
              f"{r['twin_goodput']:>14.4f}{r['naive_goodput']:>7.4f}{r['twin_faults']:>13}{r['naive_faults']:>7}"
              f"   fault-free s/step twin {r['fault_free_step_s_twin']:.4f}, naive {r['fault_free_step_s_naive']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
