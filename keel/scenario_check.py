"""Every rule a scenario must meet beyond its types, each failing with one line that names
the key (`check`, called by keel.scenario_load.from_dict). The fault classes' rules come from
their registry entries (keel.fault_classes)."""
from __future__ import annotations

import difflib
import typing

from keel import fault_classes as FC
from keel.scenario_base import MAX_FAULTS_PER_S, MAX_NODES, MAX_SHARDS, MAX_SLOTS, MAX_STEPS, ScenarioError, _unit
from keel.schema import Scenario
from keel.wire import check as check_wire


def check(s: Scenario) -> None:
    """Every rule a scenario must meet, each failing with one line naming the key. Long on
    purpose: a flat list of checks in the schema's order, each a few lines, that reads like
    the schema it enforces; splitting it would scatter the rules without sharing any."""
    src = s.source

    def fail(key: str, message: str) -> typing.NoReturn:
        raise ScenarioError(f"{src}: key '{key}': {message}")

    def positive(value: float, key: str, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            fail(key, f"expected a {'non-negative' if allow_zero else 'positive'} value{_unit(key.rsplit('.', 1)[-1])}, got {value!r}")

    positive(s.run.steps, "run.steps")
    if s.run.steps > MAX_STEPS:
        fail("run.steps", f"expected at most {MAX_STEPS:,} steps, got {s.run.steps:,}")
    positive(s.run.seed, "run.seed", True)
    if not s.run.name.strip():
        fail("run.name", "expected a non-empty name (it names the run's outputs), got an empty string")
    w = s.workload
    positive(w.step_compute_s, "workload.step_compute_s")
    check_wire(s, fail)
    positive(w.slots, "workload.slots", True)
    if w.slots > MAX_SLOTS:
        fail("workload.slots", f"expected at most {MAX_SLOTS:,} slots, got {w.slots:,}")
    positive(w.micro_batch, "workload.micro_batch")
    positive(w.compute_jitter, "workload.compute_jitter", True)
    c = s.checkpoint
    positive(c.interval_steps, "checkpoint.interval_steps")
    for k in ("weights_bytes", "optimizer_bytes"):
        positive(getattr(c, k), f"checkpoint.{k}", True)
    for k in ("write_gbyte_s", "read_gbyte_s", "snapshot_gbyte_s"):
        positive(getattr(c, k), f"checkpoint.{k}")
    positive(c.keep, "checkpoint.keep")
    if not s.regions:
        fail("regions", "expected at least one [[regions]] table")
    seen: set[str] = set()
    for i, r in enumerate(s.regions):
        if not r.name or "/" in r.name:
            fail(f"regions.{i}.name", f"expected a non-empty name without '/', got {r.name!r}")
        if r.name in seen:
            fail(f"regions.{i}.name", f"region {r.name!r} is defined twice")
        seen.add(r.name)
        positive(r.nodes, f"regions.{i}.nodes")
        positive(r.gpus_per_node, f"regions.{i}.gpus_per_node")
        positive(r.intra_gbit_s, f"regions.{i}.intra_gbit_s")
        positive(r.intra_latency_ms, f"regions.{i}.intra_latency_ms", True)
        positive(r.speed, f"regions.{i}.speed")
    if s.total_nodes > MAX_NODES:
        fail("regions", f"expected at most {MAX_NODES:,} nodes in all, got {s.total_nodes:,}")
    pairs: set[frozenset] = set()
    for i, link in enumerate(s.links):
        for end in ("a", "b"):
            name = getattr(link, end)
            if name not in seen:
                fail(f"links.{i}.{end}", f"expected one of the regions ({', '.join(sorted(seen))}), got {name!r}")
        if link.a == link.b:
            fail(f"links.{i}.b", f"a link joins two different regions, got {link.a!r} twice")
        pair = frozenset((link.a, link.b))
        if pair in pairs:
            fail(f"links.{i}", f"the link {link.a}-{link.b} is defined twice")
        pairs.add(pair)
        positive(link.rtt_ms, f"links.{i}.rtt_ms", True)
        positive(link.gbit_s, f"links.{i}.gbit_s")
        positive(link.jitter_ms, f"links.{i}.jitter_ms", True)
    if len(s.regions) > 1:
        reached = _reachable(s, s.regions[0].name)
        cut = [r.name for r in s.regions if r.name not in reached]
        if cut:
            fail("links", f"regions {s.regions[0].name!r} and {cut[0]!r} are not connected by any path of links")
    f = s.faults
    for fc in FC.classes():
        for k, zero in fc.positive:
            positive(getattr(getattr(f, fc.name), k), f"faults.{fc.name}.{k}", zero)
    rates = {f"faults.{fc.name}.{fc.rate_key}": fc.rate_per_s(getattr(f, fc.name), s.total_nodes)
             for fc in FC.classes()}
    if sum(rates.values()) > MAX_FAULTS_PER_S:
        worst = max(rates, key=rates.get)
        fail(worst, f"expected drawn faults at most {MAX_FAULTS_PER_S:g} a second over the whole cluster on "
                    f"average, got {sum(rates.values()):.3g} a second (a fault storm no run survives)")
    for i, e in enumerate(f.schedule):
        key = f"faults.schedule.{i}"
        positive(e.at_step, f"{key}.at_step", True)
        if e.at_step >= s.run.steps:
            fail(f"{key}.at_step", f"expected a step below run.steps ({s.run.steps}), got {e.at_step}")
        if e.class_ not in FC.REGISTRY:
            close = difflib.get_close_matches(e.class_, list(FC.REGISTRY), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            fail(f"{key}.class", f"expected one of {', '.join(FC.REGISTRY)}, got {e.class_!r}{hint}")
        fc = FC.get(e.class_)
        t = e.target
        if t is None and not fc.target_optional:
            fail(f"{key}.target", f"missing; a {e.class_} needs one ({fc.target_hint})")
        if (problem := fc.check_target(t, e, s)) is not None:
            fail(f"{key}.target", problem)
        if e.nodes is not None:
            positive(e.nodes, f"{key}.nodes")
        if fc.check_params is not None and (problem := fc.check_params(e, s)) is not None:
            fail(f"{key}.{problem[0]}", problem[1])
        if e.spike_ms is not None:
            positive(e.spike_ms, f"{key}.spike_ms", True)
        if e.duration_s is not None:
            positive(e.duration_s, f"{key}.duration_s", dict(fc.positive).get("duration_s", False))
    p = s.policy
    positive(p.heartbeat_s, "policy.heartbeat_s")
    positive(p.detect_timeout_s, "policy.detect_timeout_s")
    if p.detect_timeout_s < p.heartbeat_s:
        fail("policy.detect_timeout_s", f"expected at least policy.heartbeat_s ({p.heartbeat_s}), got {p.detect_timeout_s}")
    for fc in FC.classes():
        table = getattr(f, fc.name)
        if fc.check_table is not None and (problem := fc.check_table(table, s)) is not None:
            fail(f"faults.{fc.name}.{problem[0]}", problem[1])
        if not hasattr(table, "repair_hours"):
            continue
        repair_s = table.repair_hours * 3600.0
        if repair_s < p.detect_timeout_s:
            fail(f"faults.{fc.name}.repair_hours", f"expected a repair no shorter than policy.detect_timeout_s "
                 f"({p.detect_timeout_s:g} s): a node is repaired after it is found lost, got "
                 f"{table.repair_hours:g} h ({repair_s:g} s)")
    positive(p.hot_spares, "policy.hot_spares", True)
    if p.hot_spares >= s.total_nodes:
        fail("policy.hot_spares", f"expected fewer than the cluster's {s.total_nodes} nodes, got {p.hot_spares}")
    positive(p.restart_s, "policy.restart_s", True)
    positive(p.replace_node_s, "policy.replace_node_s", True)
    positive(p.coordinator_restart_s, "policy.coordinator_restart_s")
    if p.straggler_factor <= 1.0:
        fail("policy.straggler_factor", f"expected a factor above 1.0, got {p.straggler_factor}")
    positive(p.straggler_window, "policy.straggler_window")
    m = s.model
    for k in ("d_model", "layers", "heads", "context"):
        positive(getattr(m, k), f"model.{k}")
    if m.d_model % m.heads:
        fail("model.heads", f"expected a divisor of model.d_model ({m.d_model}), got {m.heads}")
    positive(m.lr, "model.lr")
    positive(m.weight_decay, "model.weight_decay", True)
    positive(s.data.shards, "data.shards")
    module, sep, factory = s.job.entry.rpartition(":")
    if s.job.entry and not (sep and module.strip() and factory.isidentifier()):
        fail("job.entry", f"expected 'package.module:factory' or 'path/to/file.py:factory', got {s.job.entry!r}")
    if s.data.shards > MAX_SHARDS:
        fail("data.shards", f"expected at most {MAX_SHARDS:,} shards, got {s.data.shards:,}")
    positive(s.validate.downtime_rel_tol, "validate.downtime_rel_tol")
    positive(s.validate.wall_rel_tol, "validate.wall_rel_tol")
    positive(s.validate.repetitions, "validate.repetitions")
    positive(s.validate.fault_rel_tol, "validate.fault_rel_tol")
    positive(s.validate.steps, "validate.steps", True)
    if s.emulation.time_scale != "auto":
        positive(s.emulation.time_scale, "emulation.time_scale")
    if not 0.0 <= s.emulation.max_overrun_fraction <= 1.0:
        fail("emulation.max_overrun_fraction", f"expected a fraction in [0, 1], got {s.emulation.max_overrun_fraction!r}")




def _reachable(s: Scenario, start: str) -> set[str]:
    """The regions a path of links joins to `start` (itself included)."""
    adj: dict[str, set[str]] = {}
    for link in s.links:
        adj.setdefault(link.a, set()).add(link.b)
        adj.setdefault(link.b, set()).add(link.a)
    seen, todo = {start}, [start]
    while todo:
        for n in adj.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


