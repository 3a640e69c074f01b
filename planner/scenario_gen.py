"""Seeded families of scenarios for the validation sweep (issue 25; bench/validate_sweep.py).

`generate(seed, index)` draws one scenario, a pure function of (seed, index), over the space the
schema describes and an emulation on a small machine can run: 4-40 nodes in 2-6 regions, full
and partial link meshes (a partial mesh routes some pairs through a third region), link speeds
and latencies over two orders of magnitude, fast and slow steps, a node or a region spiked for
a short or a long time, crashes taken by a hot spare and crashes after the spares are used up,
part of a region or all of it lost, NaN shards, the coordinator lost, sync and async
checkpoints inside the window, both policies, several detection timeouts and straggler
settings. A member's data set has as few shards as make a step read every one (`data_shards`).
Each member is checked like a loaded file (keel.scenario_load.from_dict) and comes
with its `features`, the labels the sweep's report groups errors by.

What the family leaves out, and why: one region (the calibration loses the last region whole,
planner/calibrate.py, so a one-region cluster cannot be calibrated), `policy.replace_node_s`
(the emulation does not wait for a replacement node, docs/emulation.md), stochastic fault
rates (validation replays the schedule only).

The emulated cluster's time scale is "auto": keel measures what this machine keeps.
"""
from __future__ import annotations

import math
import random
from typing import Any

from keel.scenario import Scenario
from keel.scenario_load import from_dict

REGION_NAMES = ("us-east", "us-west", "eu-west", "eu-north", "ap-southeast", "ap-northeast")
FAULT_GAP_STEPS = 5      # steps between two scheduled faults: one episode is over before the next
LEAD_STEPS = 6           # fault-free steps before the first fault: the runtime takes its pace from at
                         # least 3 full-membership intervals after 2 of warm-up (keel.metrics)
TAIL_STEPS = 4           # steps after the last fault
SHARD_MISS = 1e-3        # the most likely a step misses a given shard (`data_shards`)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _sig(x: float, digits: int = 3) -> float:
    """`x` to `digits` significant figures (readable files)."""
    return float(f"{x:.{digits}g}")


def _regions(rng: random.Random, max_nodes: int) -> list[dict[str, Any]]:
    count = rng.randint(2, min(6, max(2, max_nodes // 2)))
    total = rng.randint(max(4, 2 * count), max(4, 2 * count, max_nodes))
    sizes = [2] * count  # every region at least 2 nodes: a partial loss leaves one
    for _ in range(total - sum(sizes)):
        sizes[rng.randrange(count)] += 1
    intra = _log_uniform(rng, 50.0, 3200.0)
    return [{"name": REGION_NAMES[i], "nodes": n, "gpus_per_node": 8, "intra_gbit_s": _sig(intra),
             "intra_latency_ms": _sig(_log_uniform(rng, 0.005, 0.5)),
             "speed": rng.choice((1.0, 1.0, 1.0, 0.8, 1.25))} for i, n in enumerate(sizes)]


def _links(rng: random.Random, names: list[str], full: bool) -> list[dict[str, Any]]:
    """A random spanning tree (every region reachable), plus every other pair (a full mesh) or
    some of them (a partial one: the missing pairs route through other regions)."""
    order = names[:]
    rng.shuffle(order)
    pairs = {tuple(sorted((order[i], rng.choice(order[:i])))) for i in range(1, len(order))}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if full or rng.random() < 0.3:
                pairs.add(tuple(sorted((a, b))))
    return [{"a": a, "b": b, "rtt_ms": _sig(_log_uniform(rng, 2.0, 250.0)),
             "gbit_s": _sig(_log_uniform(rng, 10.0, 1000.0)), "jitter_ms": _sig(rng.choice((0.0, 0.5, 2.0, 5.0)))}
            for a, b in sorted(pairs)]


class _Draw:
    """The schedule being drawn: which nodes are alive, what was struck so far."""

    def __init__(self, rng: random.Random, regions: list[dict[str, Any]], spares: int, training: list[str],
                 step_s: float):
        self.rng, self.spares, self.step_s = rng, spares, step_s
        self.alive = {r["name"]: [f"{r['name']}/{i}" for i in range(r["nodes"])] for r in regions}
        self.trained = set(training)
        self.crashes = 0
        self.region_lost = False

    def live_regions(self) -> list[str]:
        return [r for r, ns in self.alive.items() if ns]

    def crash(self) -> tuple[dict[str, Any], str] | None:
        """A training node that is still alive dies (while at least 3 are left)."""
        live = [n for ns in self.alive.values() for n in ns if n in self.trained]
        if len(live) <= 2:
            return None
        node = self.rng.choice(live)
        self.alive[node.split("/")[0]].remove(node)
        self.crashes += 1
        return {"target": node}, "crash with a spare" if self.crashes <= self.spares else "crash, spares used up"

    def rack(self) -> tuple[dict[str, Any], str] | None:
        """Part of a region or all of it (once a run), leaving live nodes elsewhere."""
        regions = self.live_regions()
        candidates = [r for r in regions if len(regions) > 1 and sum(len(self.alive[o]) for o in regions if o != r) >= 2]
        if self.region_lost or not candidates:
            return None
        region = self.rng.choice(candidates)
        whole = self.rng.random() < 0.5 or len(self.alive[region]) < 2
        nodes = len(self.alive[region]) if whole else self.rng.randint(1, len(self.alive[region]) - 1)
        self.alive[region] = self.alive[region][nodes:]  # the region's first live nodes (keel.recovery.rack_victims)
        self.region_lost = True
        return {"target": region, "nodes": nodes}, "whole region lost" if whole else "part of a region lost"

    def spike(self) -> tuple[dict[str, Any], str]:
        """A live node's or a live region's latency spike, one or 2.5 steps long."""
        regions = self.live_regions()
        on_node = self.rng.random() < 0.5 or len(regions) < 2
        target = self.rng.choice([n for r in regions for n in self.alive[r]]) if on_node else self.rng.choice(regions)
        spike_ms = _sig(_log_uniform(self.rng, 50.0, 1000.0))
        duration = _sig(self.step_s * self.rng.choice((1.0, 2.5)))
        label = f"{'node' if on_node else 'region'} spike, {'long' if duration > 2 * self.step_s else 'short'}"
        return {"target": target, "spike_ms": spike_ms, "duration_s": duration}, label

    def nan_shard(self) -> tuple[dict[str, Any], str]:
        """A shard yields NaN; which one is settled once the data set's shard count is
        (`_nan_targets`): here only the draw."""
        return {"shard_draw": self.rng.randrange(16)}, "NaN shard"

    def coordinator(self) -> tuple[dict[str, Any], str]:
        return {"target": "coordinator"}, "coordinator lost"


# per class: (weight, how to draw one, the class drawn instead where it cannot strike)
KINDS = {"hardware_fault": (3, _Draw.crash, "data_shard_skew"),
         "network_jitter": (3, _Draw.spike, None),
         "partial_cluster_loss": (2, _Draw.rack, "hardware_fault"),
         "data_shard_skew": (2, _Draw.nan_shard, None),
         "coordinator_loss": (1, _Draw.coordinator, None)}


def _schedule(rng: random.Random, regions: list[dict[str, Any]], spares: int, training: list[str],
              step_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    """2-4 scheduled faults on live targets, FAULT_GAP_STEPS apart, and their feature labels.
    Capacity lasts: a crash takes a training node that is still alive, a region loss leaves
    other regions with live nodes, at most one region is lost."""
    draw = _Draw(rng, regions, spares, training, step_s)
    names = list(KINDS)
    events, labels = [], []
    for k in range(rng.randint(2, 4)):
        kind = rng.choices(names, [KINDS[n][0] for n in names])[0]
        got = KINDS[kind][1](draw)
        while got is None:  # it cannot strike here: its stand-in (which always can, in the end)
            kind = KINDS[kind][2]
            got = KINDS[kind][1](draw)
        entry, label = got
        events.append({"at_step": LEAD_STEPS + k * FAULT_GAP_STEPS, "class": kind, **entry})
        labels.append(label)
    return events, labels


def data_shards(samples: int, nan_faults: int) -> int:
    """The member's `data.shards`: the most (up to 16) at which a step of `samples` samples,
    each drawn uniformly over the live shards (runtime/data.Sampler), misses a given one with
    probability at most SHARD_MISS, so that a NaN shard strikes the step the schedule names,
    as on a cluster, where a step's thousands of samples read every shard (the twin takes the
    step in flight, twin/fault_kinds/data_shard_skew.py). With 16 shards and 4-6 slots of 4
    samples the step in flight missed the shard 1 time in 3 to 5 (sweep members 1/13 and 1/15,
    6 Dec). Each NaN fault quarantines a shard: one is left after the last."""
    fits = max([s for s in range(2, 17) if (1 - 1 / s) ** samples <= SHARD_MISS], default=2)
    return max(fits, nan_faults + 1)


def _nan_targets(events: list[dict[str, Any]], shards: int) -> None:
    """Each NaN fault's shard: its draw among the shards no earlier one quarantined."""
    live = list(range(shards))
    for e in events:
        if "shard_draw" in e:
            e["target"] = f"shard/{live.pop(e.pop('shard_draw') % len(live))}"


def generate(seed: int, index: int, max_nodes: int = 40) -> tuple[Scenario, dict[str, Any]]:
    """Member `index` of family `seed`: the scenario and its features (labels for the report)."""
    raw, features = draw(seed, index, max_nodes)
    return from_dict(raw, f"<sweep {seed}/{index}>"), features


def draw(seed: int, index: int, max_nodes: int = 40) -> tuple[dict[str, Any], dict[str, Any]]:
    """Member `index` of family `seed` as the keys drawn (a scenario file's tables) and its features."""
    rng = random.Random(f"keel-sweep/{seed}/{index}")
    max_nodes = max(4, min(40, max_nodes))
    regions = _regions(rng, max_nodes)
    names = [r["name"] for r in regions]
    full = rng.random() < 0.5
    links = _links(rng, names, full)
    total = sum(r["nodes"] for r in regions)
    spares = rng.choice((0, 1, 1, 2)) if total > 4 else rng.choice((0, 1))
    fast = rng.random() < 0.5
    step_s = _sig(_log_uniform(rng, 0.3, 1.0) if fast else _log_uniform(rng, 2.0, 8.0))
    params = int(_sig(_log_uniform(rng, 1e8, 5e9), 2))
    node_names = [f"{r['name']}/{i}" for r in regions for i in range(r["nodes"])]
    training = node_names[:total - spares]
    events, labels = _schedule(rng, regions, spares, training, step_s)
    micro_batch = 4
    shards = data_shards(len(training) * micro_batch, sum("shard_draw" in e for e in events))
    _nan_targets(events, shards)
    steps = LEAD_STEPS + FAULT_GAP_STEPS * (len(events) - 1) + TAIL_STEPS
    detect = rng.choice((1.0, 2.0, 5.0))
    policy_kind = "checkpoint_restart" if rng.random() < 0.3 else "absorb"
    mode = rng.choice(("async", "sync"))
    raw = {
        "run": {"name": f"sweep-{seed}-{index}", "seed": seed * 1000 + index, "steps": steps},
        "workload": {"step_compute_s": step_s, "params": params, "gradient_dtype": rng.choice(("bf16", "float32")),
                     "slots": len(training), "micro_batch": micro_batch, "compute_jitter": rng.choice((0.0, 0.02, 0.05))},
        "checkpoint": {"interval_steps": rng.randint(3, 6), "mode": mode, "weights_bytes": 2 * params,
                       "optimizer_bytes": 12 * params, "write_gbyte_s": _sig(_log_uniform(rng, 1.0, 10.0)),
                       "read_gbyte_s": _sig(_log_uniform(rng, 2.0, 20.0)), "snapshot_gbyte_s": 25.0, "keep": 2},
        "regions": regions,
        "links": links,
        "faults": {"hardware_fault": {"repair_hours": 4.0}, "partial_cluster_loss": {"repair_hours": 2.0},
                   "schedule": events},
        "policy": {"kind": policy_kind, "heartbeat_s": detect / rng.choice((4, 5)), "detect_timeout_s": detect,
                   "hot_spares": spares, "restart_s": _sig(rng.uniform(5.0, 30.0)), "replace_node_s": 0.0,
                   "straggler_factor": rng.choice((1.3, 1.5, 2.0)), "straggler_window": rng.choice((1, 2, 3))},
        "model": {"d_model": 64, "layers": 2, "heads": 4, "context": 64},
        "data": {"shards": shards},
        "emulation": {"time_scale": "auto"},
        "validate": {"repetitions": 2, "steps": steps},
    }
    features = {
        "nodes": "4-8 nodes" if total <= 8 else "9-20 nodes" if total <= 20 else "21-40 nodes",
        "regions": f"{len(regions)} regions",
        "mesh": "full mesh" if len(links) == len(names) * (len(names) - 1) // 2 else "partial mesh (routed)",
        "step": "fast steps (<1 s)" if fast else "slow steps (2-8 s)",
        "policy": policy_kind,
        "checkpoint": f"{mode} checkpoints",
        "spares": f"{spares} spare(s)",
        "detection": f"detect {detect:g} s",
        "straggler": f"straggler x{raw['policy']['straggler_factor']:g} for {raw['policy']['straggler_window']}",
        "faults": labels,
    }
    return raw, features


def toml_text(scenario: Scenario, features: dict[str, Any]) -> str:
    """The member as a scenario file to replay (`keel validate FILE`), its features in a comment."""
    from keel.scenario_load import dumps
    head = "".join(f"# {k}: {', '.join(v) if isinstance(v, list) else v}\n" for k, v in features.items())
    return f"# {scenario.run.name}: a member of the validation sweep's family (planner/scenario_gen.py)\n{head}\n" \
        + dumps(scenario)
