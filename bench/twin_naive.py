"""The twin's speed against a straightforward SimPy model of the same scenario: one process per
node and step (each node draws its compute, the step ends when the slowest is done, then the
reduction), with every figure taken from the twin's own cost model (per-node compute, jitter,
reduction chains, detection, re-form, state copy, checkpoint pause) and every decision from
keel.recovery, so only the event structure differs. The scenario is bench/twin_speed.py's
46-node cluster scaled to 46, 512 and 2,048 nodes, hardware faults only (the naive model has no
other class), a node MTBF of 200 h instead of 5,000 h so each horizon sees a few, absorb with hot
spares, over as many steps as the naive model simulates in a second or so.

Both models draw their faults from the same seeded stream (the twin's own, for the seed), so a
seed's faults strike the same nodes at the same times in both: the goodputs are compared seed by
seed, and what is left between them is the step draws' noise. Reported: wall seconds of each and
their ratio, the fault-free pace, the goodput of each and their paired difference, the faults.

The twin's mean wall time over `--hand-seeds` seeds is compared with the expectation worked out
from the scenario's rates and costs (`by_hand`); `--by-hand` compares both models' with it (the
naive model over as many seeds takes minutes).

    .venv/bin/python bench/twin_naive.py [--seeds 5] [--hand-seeds 500] [--json]
    .venv/bin/python bench/twin_naive.py --by-hand --seeds 200
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import simpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import twin  # noqa: E402
from bench.twin_speed import scaled  # noqa: E402
from keel import recovery as R  # noqa: E402
from twin.model import Simulation  # noqa: E402
from twin.params import TwinParams  # noqa: E402
from twin.steps import StepShape  # noqa: E402

# (nodes, steps): about 200k node-steps each, a second or so of the naive model
CASES = [(46, 4000), (512, 300), (2048, 75)]
MTBF_NODE_HOURS = 200.0  # a node fails every 200 h (the scenario: 5,000 h), so each horizon sees a few faults


def scenario_for(nodes: int, steps: int, mtbf_node_hours: float = MTBF_NODE_HOURS):
    """bench/twin_speed.py's cluster at `nodes`, `steps` long, hardware faults only."""
    sc = scaled(nodes, 1.0)
    f = sc.faults
    off = {field.name: dataclasses.replace(getattr(f, field.name), per_day=0.0) for field in dataclasses.fields(f)
           if hasattr(getattr(f, field.name), "per_day")}
    faults = dataclasses.replace(f, hardware_fault=dataclasses.replace(f.hardware_fault, mtbf_node_hours=mtbf_node_hours),
                                 schedule=(), **off)
    return dataclasses.replace(sc, faults=faults, run=dataclasses.replace(sc.run, steps=steps))


def naive(sc, seed: int) -> dict:
    """One process per node and step; the step ends when the slowest node is done, then the
    reduction. A fault on a node holding a slot loses the step in flight; at its detection the
    slot moves (keel.recovery.place_lost_slots: the first idle spare, else the fastest finish),
    the job pauses to re-form (and copy the state to a spare), and the step is redone. A fault
    during a pause breaks it (it starts over once every fault is detected); one on an idle
    spare only takes the spare away. A repaired node rejoins as a spare and relieves an
    overloaded node at the next step boundary."""
    sim = Simulation(sc, TwinParams.from_scenario(sc), seed)  # for its cost figures only
    p = sim.params
    nodes = sim.cluster.order  # scenario order; read, never changed
    count = len(nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    slots = [n.slots for n in nodes]
    role = [n.role for n in nodes]  # train | spare | down
    up = [True] * count
    healthy_load = max(k / n.speed for k, n in zip(slots, nodes))
    region_names = sim.topology.region_names
    action = R.action_for("hardware_fault", sc.policy.kind, sc.policy.quarantine)
    # the twin's own (unused) streams of hardware faults and their detection for this seed, so
    # both models see the same faults strike at the same times (a fault that strikes in one
    # and not the other is reported); the steps come from a stream of the naive model's own
    rng_detect, rng_faults = sim.faults.rng_detect, sim.faults.rng_hardware
    rng = np.random.default_rng([seed, 1])
    env = simpy.Environment()
    ckpt_pause_s = sim.cost.share_s(p.ckpt_snapshot_gbyte_s if sc.checkpoint.mode == "async" else p.ckpt_write_gbyte_s)
    hw = sc.faults.hardware_fault
    st = {"committed": 0, "ckpt": 0, "recovery_s": None, "rejoined": False, "waiting": None}
    undetected: dict[int, float] = {}  # node -> when its death is detected
    struck: list[tuple[float, str]] = []
    layouts: dict[tuple, tuple[dict[str, float], StepShape]] = {}

    def layout() -> tuple[dict[str, float], StepShape]:
        """Each region's reduction chain (its nodes' offset) and the step's fixed parts for the
        current members, from the twin's cost model: a trial layout whose slot counts tag the
        regions, so each of its groups names its region."""
        members = [i for i in range(count) if up[i] and role[i] == "train" and slots[i] > 0]
        key = tuple(sum(1 for i in members if nodes[i].region == r) for r in region_names)
        if key not in layouts:
            tag = {r: k + 1 for k, r in enumerate(region_names)}
            shape = sim.cost.shape(with_spikes=False, nodes=[nodes[i] for i in members],
                                   slots={nodes[i].name: tag[nodes[i].region] for i in members})
            base = {tag[n.region] * p.slot_compute_s / n.speed: n.region for n in (nodes[i] for i in members)}
            assert len(base) == len({nodes[i].region for i in members}), "regions not told apart"
            layouts[key] = ({base[b]: off for _, b, off in shape.groups}, shape)
        return layouts[key]

    def node(i: int, offset: float, start: simpy.Event, done: list):
        yield start
        t = slots[i] * p.slot_compute_s / nodes[i].speed * max(1.0 + p.compute_jitter * rng.standard_normal(), 0.0)
        yield env.timeout(t + offset)
        done[0] += 1
        if done[0] == done[1]:
            done[2].succeed()

    def wait(duration, state: str):
        """The trainer waits; False if a fault interrupted it."""
        st["waiting"] = state
        try:
            yield env.timeout(max(duration, 0.0)) if not isinstance(duration, simpy.Event) else duration
            return True
        except simpy.Interrupt:
            return False
        finally:
            st["waiting"] = None

    def detect(i: int) -> None:
        del undetected[i]
        lost, slots[i], role[i] = slots[i], 0, "down"
        spares = [nodes[j].name for j in range(count) if up[j] and role[j] == "spare"][:1]
        holders = lambda: [R.Holder(nodes[j].name, nodes[j].region, nodes[j].speed, slots[j], j)  # noqa: E731
                           for j in range(count) if up[j] and role[j] == "train"]
        pause = p.reform_s
        for name, k in Counter(R.place_lost_slots(action, lost, holders, spares, region_names)).items():
            j = index[name]
            if role[j] == "spare":
                role[j] = "train"
                pause += p.spare_takeover_s + sim.cost.transfer_s([(name, k)])
            slots[j] += k
        st["recovery_s"] = max(st["recovery_s"] or 0.0, pause)

    def rebalance() -> float:
        """A rejoined spare takes half the slots of the most loaded node (as twin/stragglers.py)."""
        moved = []
        while True:
            spares = [j for j in range(count) if up[j] and role[j] == "spare"]
            train = [j for j in range(count) if up[j] and role[j] == "train"]
            worst = max(train, key=lambda j: (slots[j] / nodes[j].speed, -j))
            if not spares or slots[worst] / nodes[worst].speed <= healthy_load + 1e-12 or slots[worst] < 2:
                break
            give = slots[worst] // 2
            slots[worst] -= give
            role[spares[0]], slots[spares[0]] = "train", give
            moved.append((nodes[spares[0]].name, give))
        return p.reform_s + p.spare_takeover_s + sim.cost.transfer_s(moved) if moved else 0.0

    def trainer():
        interval = sc.checkpoint.interval_steps
        while True:
            if undetected:
                if (yield from wait(min(undetected.values()) - env.now, "stalled")):
                    for i in sorted(undetected, key=undetected.get):
                        if undetected[i] <= env.now:
                            detect(i)
            elif st["recovery_s"] is not None:
                if (yield from wait(st["recovery_s"], "paused")):
                    st["recovery_s"] = None
            elif st["committed"] >= sc.run.steps:
                return
            elif st["rejoined"]:
                st["rejoined"] = False
                yield from wait(rebalance(), "paused")
            elif 0 < st["committed"] < sc.run.steps and st["committed"] % interval == 0 and st["committed"] > st["ckpt"]:
                if (yield from wait(ckpt_pause_s, "paused")):
                    st["ckpt"] = st["committed"]
            else:
                offsets, shape = layout()
                live = [i for i in range(count) if up[i] and role[i] == "train" and slots[i] > 0]
                start, finished = env.event(), env.event()
                done = [0, len(live), finished]
                for i in live:  # the latency part of the reduction is waited below, with its noise
                    env.process(node(i, offsets[nodes[i].region] - shape.latency_s, start, done))
                start.succeed()
                if (yield from wait(finished, "running")):
                    noise = max(shape.link_jitter_s * rng.standard_normal(), -shape.latency_s)
                    if (yield from wait(shape.fixed_s + shape.latency_s + noise, "running")):
                        st["committed"] += 1

    def repair(i: int):
        yield env.timeout(hw.repair_hours * 3600.0)
        up[i], role[i], slots[i] = True, "spare", 0
        st["rejoined"] = True

    def faults():
        rate = count / (hw.mtbf_node_hours * 3600.0)
        while True:
            yield env.timeout(rng_faults.exponential(1.0 / rate))
            i = int(rng_faults.integers(count))
            if not up[i]:
                continue  # already down: nothing stops
            struck.append((env.now, nodes[i].name))
            up[i] = False
            env.process(repair(i))
            if role[i] == "spare":
                role[i] = "down"
                continue
            spread = min(p.heartbeat_s, 2 * p.detect_kill_s)
            undetected[i] = env.now + max(0.0, p.detect_kill_s + spread * (0.5 - float(rng_detect.random())))
            if st["waiting"] is not None and trainer_proc.is_alive:
                trainer_proc.interrupt(nodes[i].name)

    t0 = time.perf_counter()
    trainer_proc = env.process(trainer())
    if hw.mtbf_node_hours > 0:
        env.process(faults())
    env.run(until=trainer_proc)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "sim_s": env.now, "faults": len(struck), "struck": struck,
            "goodput": min(1.0, sc.run.steps * sim.healthy_step_s / env.now)}


def keel_twin(sc, seed: int) -> dict:
    t0 = time.perf_counter()
    result = twin.simulate(sc, seed=seed)
    s = result.summary
    return {"wall_s": time.perf_counter() - t0, "sim_s": s["wall_s"], "faults": len(s["faults"]), "goodput": s["goodput"],
            "struck": [(e.t, e.target) for e in result.events if e.kind == "fault"]}


def same_faults(a: dict, b: dict) -> bool:
    """The same nodes struck at the same times, up to the end of the shorter run."""
    end = min(a["sim_s"], b["sim_s"])
    return ([(round(t, 6), n) for t, n in a["struck"] if t < end]
            == [(round(t, 6), n) for t, n in b["struck"] if t < end])


# ----------------------------------------------------------------------------- by hand

def by_hand(sc) -> dict:
    """The expected wall time of the scenario, from its rates and costs. Every node fails at
    1/MTBF and stays down for repair_hours (longer than the horizon's faults need), so the
    faults by time t are Binomial(nodes, 1 - exp(-t / MTBF)). Each one that strikes a node
    holding a slot costs what the step in flight had run (half a step) + detection + re-form
    (+ the state copy where a spare takes over). Once the hot spares are gone (the faults
    beyond the spares' count: hot_spares + 1), the fastest survivor carries two slots and
    every step takes the doubled step time, until the first node to fail is back from repair
    as a spare and takes that slot. With t1, ts the first and (spares + 1)-th failure times
    (order statistics of iid exponentials), the work done in the slowdown is
    min(T0 - ts, (t1 + repair - ts) / r), r = doubled step / step; the extra wall is (r - 1)
    times it. Left out: a fourth fault in the slowdown (a second node with two slots: a
    slightly slower step) and faults during a pause."""
    sim = Simulation(sc, TwinParams.from_scenario(sc), 0)
    p, cost, nodes = sim.params, sim.cost, sim.cluster.order
    step = sim.healthy_step_s
    n, spares = len(nodes), sc.policy.hot_spares
    # the layout once the spares are gone: they hold the first lost slots, the next goes to
    # the fastest finish over the rest
    slots = {x.name: x.slots for x in nodes}
    train = [x for x in nodes if x.slots > 0]
    for victim, spare in zip(reversed(train), [x for x in nodes if x.role == "spare"]):
        slots[victim.name], slots[spare.name] = 0, 1
    slots[train[-spares - 1].name] = 0
    holders = [R.Holder(x.name, x.region, x.speed, slots[x.name], x.index) for x in nodes if slots[x.name] > 0]
    slots[R.fastest_finish(1, holders)[0]] += 1
    doubled = cost.expected_s(cost.shape(with_spikes=False, nodes=list(nodes), slots=slots))
    r = doubled / step
    ckpt = cost.share_s(p.ckpt_snapshot_gbyte_s if sc.checkpoint.mode == "async" else p.ckpt_write_gbyte_s)
    t0 = sc.run.steps * step + (sc.run.steps - 1) // sc.checkpoint.interval_steps * ckpt
    spare_node = [x.name for x in nodes if x.role == "spare"][:1]
    copy = cost.transfer_s([(spare_node[0], 1)]) if spare_node else 0.0
    per_fault = step / 2 + p.detect_kill_s + p.reform_s + p.spare_takeover_s + copy
    mu = 1.0 / (sc.faults.hardware_fault.mtbf_node_hours * 3600.0)
    repair = sc.faults.hardware_fault.repair_hours * 3600.0
    F = lambda t: -math.expm1(-mu * t)  # noqa: E731
    f = lambda t: mu * math.exp(-mu * t)  # noqa: E731
    k = spares + 1  # the fault that finds no spare
    coef = math.factorial(n) / (math.factorial(k - 2) * math.factorial(n - k)) if n > k else 0.0
    grid = 600
    h = t0 / grid
    slow_work = 0.0
    for i in range(grid):  # t1
        x = (i + 0.5) * h
        for j in range(i + 1, grid):  # ts
            y = (j + 0.5) * h
            if y >= x + repair:
                break  # the first node is back as a spare before the k-th fault
            dens = coef * f(x) * f(y) * (F(y) - F(x)) ** (k - 2) * (1 - F(y)) ** (n - k)
            slow_work += dens * h * h * min(t0 - y, (x + repair - y) / r)
    extra = (r - 1) * slow_work
    faults = n * F(t0) + n * mu * extra  # the slowdown's extra wall sees faults too
    q = F(t0)  # P(spares + 1 faults within the fault-free horizon): the runs that slow down
    p_slow = 1.0 - sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(min(k, n + 1)))
    return {"step_s": step, "doubled_step_s": doubled, "fault_free_wall_s": t0, "faults": faults,
            "cost_per_fault_s": per_fault, "slowdown_s": extra, "p_slowdown": p_slow,
            "wall_s": t0 + faults * per_fault + extra}


def against_hand(sc, seeds: int, models: tuple[str, ...]) -> dict:
    """Each model's mean wall time (and its standard error) over `seeds` seeds, and `by_hand`'s."""
    run = {"twin": keel_twin, "naive": naive}
    out: dict = {"seeds": seeds, "hand": by_hand(sc)}
    for name in models:
        runs = [run[name](sc, seed) for seed in range(seeds)]
        walls = [x["sim_s"] for x in runs]
        out[name] = {"wall_s": statistics.mean(walls), "wall_se": statistics.stdev(walls) / math.sqrt(len(walls)),
                     "faults": statistics.mean(x["faults"] for x in runs),
                     "goodput": statistics.mean(x["goodput"] for x in runs)}
    return out


# ----------------------------------------------------------------------------- main

def measure(seeds: int, hand_seeds: int, bar) -> list[dict]:
    rows = []
    for nodes, steps in CASES:
        sc = scenario_for(nodes, steps)
        k, n = [], []
        for seed in range(seeds):  # interleaved
            n.append(naive(sc, seed))
            k.append(keel_twin(sc, seed))
            bar.update()
        ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(n, k)]
        diffs = [a["goodput"] - b["goodput"] for a, b in zip(n, k)]
        clean = scenario_for(nodes, steps, 0.0)  # no faults: the same fault-free pace?
        clean_twin, clean_naive = keel_twin(clean, 0), naive(clean, 0)
        rows.append({
            "nodes": nodes, "steps": steps, "seeds": seeds,
            "simulated_h": statistics.mean(x["sim_s"] for x in k) / 3600,
            "twin_wall_s": statistics.median(x["wall_s"] for x in k),
            "naive_wall_s": statistics.median(x["wall_s"] for x in n),
            "naive_over_twin": statistics.median(ratios), "naive_over_twin_range": [min(ratios), max(ratios)],
            "twin_goodput": statistics.mean(x["goodput"] for x in k),
            "naive_goodput": statistics.mean(x["goodput"] for x in n),
            "goodput_diff_mean": statistics.mean(diffs), "goodput_diff_max_abs": max(abs(d) for d in diffs),
            "twin_faults": sum(x["faults"] for x in k), "naive_faults": sum(x["faults"] for x in n),
            "same_faults": sum(same_faults(a, b) for a, b in zip(n, k)),
            "fault_free_step_s_twin": clean_twin["sim_s"] / steps, "fault_free_step_s_naive": clean_naive["sim_s"] / steps,
            "by_hand": against_hand(sc, hand_seeds, ("twin",))})
    return rows


def print_hand(nodes: int, steps: int, r: dict) -> None:
    h = r["hand"]
    print(f"{nodes} nodes x {steps} steps: step {h['step_s']:.4f} s (one node with two slots: {h['doubled_step_s']:.4f}), "
          f"fault-free wall {h['fault_free_wall_s']:.1f} s; by hand {h['faults']:.3f} faults x "
          f"{h['cost_per_fault_s']:.2f} s + slowdown {h['slowdown_s']:.1f} s = wall {h['wall_s']:.1f} s")
    for name in ("twin", "naive"):
        if name in r:
            m = r[name]
            print(f"  {name:>5}, {r['seeds']} seeds: wall {m['wall_s']:.1f} +- {m['wall_se']:.1f} s (s.e.), "
                  f"{m['faults']:.3f} faults, goodput {m['goodput']:.4f}; "
                  f"(mean - hand) / s.e. = {(m['wall_s'] - h['wall_s']) / m['wall_se']:+.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds per case for the side-by-side runs")
    ap.add_argument("--hand-seeds", type=int, default=500, help="seeds of the twin's runs compared with by_hand")
    ap.add_argument("--by-hand", action="store_true",
                    help="only compare both models' mean wall over --seeds seeds with by_hand")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.seeds < 2 or args.hand_seeds < 2:
        print(f"--seeds {args.seeds}, --hand-seeds {args.hand_seeds}: expected at least 2 each", file=sys.stderr)
        return 2
    if args.by_hand:
        rows = [dict(against_hand(scenario_for(n, s), args.seeds, ("twin", "naive")), nodes=n, steps=s) for n, s in CASES]
        if args.json:
            print(json.dumps(rows, sort_keys=True))
        for r in [] if args.json else rows:
            print_hand(r["nodes"], r["steps"], r)
        return 0
    from keel.progress import progress_bar
    with progress_bar(total=len(CASES) * args.seeds, desc="twin vs naive", unit="run") as bar:
        rows = measure(args.seeds, args.hand_seeds, bar)
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    print(f"twin vs the naive SimPy model (one process per node and step); hardware faults only, the same "
          f"faults in both; {args.seeds} seeds, interleaved")
    print(f"{'nodes':>6}{'steps':>7}{'sim h':>7}{'twin s':>9}{'naive s':>9}{'naive/twin':>16}"
          f"{'goodput twin':>14}{'naive':>8}{'diff (max)':>20}{'faults':>8}{'same':>6}")
    for r in rows:
        print(f"{r['nodes']:>6}{r['steps']:>7}{r['simulated_h']:>7.1f}{r['twin_wall_s']:>9.3f}{r['naive_wall_s']:>9.2f}"
              f"{r['naive_over_twin']:>6.0f} [{r['naive_over_twin_range'][0]:.0f}-{r['naive_over_twin_range'][1]:.0f}]"
              f"{r['twin_goodput']:>14.4f}{r['naive_goodput']:>8.4f}"
              f"{r['goodput_diff_mean']:>+11.5f} ({r['goodput_diff_max_abs']:.5f})"
              f"{r['twin_faults']:>5}/{r['naive_faults']:<3}{r['same_faults']:>3}/{r['seeds']}"
              f"   fault-free s/step twin {r['fault_free_step_s_twin']:.4f}, naive {r['fault_free_step_s_naive']:.4f}, "
              f"cost model {r['by_hand']['hand']['fault_free_wall_s'] / r['steps']:.4f}")
    for r in rows:
        print_hand(r["nodes"], r["steps"], r["by_hand"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
