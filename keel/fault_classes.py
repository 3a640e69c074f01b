"""The fault classes: one registry entry each, the only place that lists them.

An entry says everything about a class that is not behaviour: its scenario table
(`[faults.<name>]`, a frozen dataclass with its defaults), what a scheduled entry's target
is and how it is checked, which of the schedule's keys override the table's, the action
under each policy, whether an episode has a duration, its drawn rate, how the runtime
injects it, its colour in charts. Its behaviour lives in one twin module (`twin`) and one
runtime module (`runtime`), named here and imported by twin/fault_kinds and
runtime/coordinator/injections; keel imports neither.

Everything that lists classes is generated from `REGISTRY`: `FAULT_CLASSES`, the scenario's
`Faults` table and its checks, `keel.recovery.ABSORB_ACTION`, `action_for` and
`resolve_schedule`, `keel.metrics.open_at_end`, the planner's `schedule_only` and
`interruptions_per_s`, the dashboard's colours and rate fields, the runtime's injection modes.
`get(name)` of a name not registered raises: no class falls through to another's behaviour.

A new class touches four places: its entry here, its twin module, its runtime module, tests.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from keel.scenario_base import _doc, _is_index

COORDINATOR = "coordinator"  # the target of every coordinator_loss: there is one coordinator per job
HOUR = 3600.0
DAY = 86400.0


# ----------------------------------------------------------------------------- the tables

@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareFault:
    mtbf_node_hours: float = _doc("mean time between failures of one node, hours; 0 = off", 0.0)
    repair_hours: float = _doc("hours until a failed node is repaired and rejoins as a spare", 4.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkJitter:
    per_day: float = _doc("latency spikes per day over the cluster; 0 = off", 0.0)
    spike_ms: float = _doc("extra latency of a spike, ms", 200.0)
    duration_s: float = _doc("duration of a spike, s", 60.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialClusterLoss:
    per_day: float = _doc("rack power events per day over the cluster; 0 = off", 0.0)
    nodes: int = _doc("nodes of one region lost at once", 4)
    repair_hours: float = _doc("hours until the lost nodes rejoin as spares", 2.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataShardSkew:
    per_day: float = _doc("shards that start yielding NaN, per day; 0 = off", 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorLoss:
    per_day: float = _doc("deaths of the coordinator process per day (one per job; its supervisor "
                          "starts a successor); 0 = off", 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkPartition:
    per_day: float = _doc("network partitions per day over the cluster (a node or a region cut off from the "
                          "rest: packets dropped, no reset, its processes alive); 0 = off", 0.0)
    duration_s: float = _doc("seconds from the cut to its heal; 0 = it does not heal within the run. It must "
                             "outlast policy.detect_timeout_s: the cut-off nodes are then counted lost", 0.0)
    rejoin_hours: float = _doc("hours from the heal until the cut-off nodes' workers, told to leave, are "
                               "started again and rejoin as spares", 0.5)


# ----------------------------------------------------------------------------- targets
# Each returns the message for a target `t` the scenario `s` does not have, or None.

def node_target(t: str, e: Any, s: Any) -> str | None:
    if t not in set(s.node_names):
        return f"expected a node 'region/i' of this cluster (e.g. {s.node_names[0]!r}), got {t!r}"
    return None


def region_target(t: str, e: Any, s: Any) -> str | None:
    regions = {r.name for r in s.regions}
    if t not in regions:
        return f"expected a region name ({', '.join(sorted(regions))}), got {t!r}"
    return None


def node_or_region_target(t: str, e: Any, s: Any) -> str | None:
    if t not in {r.name for r in s.regions} and t not in set(s.node_names):
        return f"expected a region name or a node 'region/i', got {t!r}"
    return None


def shard_target(t: str, e: Any, s: Any) -> str | None:
    if not (t.startswith("shard/") and _is_index(t[6:]) and int(t[6:]) < s.data.shards):
        return f"expected 'shard/N' with N below data.shards ({s.data.shards}), got {t!r}"
    return None


def coordinator_target(t: str | None, e: Any, s: Any) -> str | None:
    if t not in (None, COORDINATOR):
        return f"expected {COORDINATOR!r} (or no target) for a {e.class_}, got {t!r}"
    return None


def rack_size(e: Any, s: Any) -> tuple[str, str] | None:
    """A rack loss takes at most its region's nodes."""
    if e.nodes is not None and e.nodes > s.region(e.target).nodes:
        return "nodes", f"region {e.target!r} has {s.region(e.target).nodes} nodes, cannot lose {e.nodes}"
    return None


def _heals_too_soon(d: float, s: Any) -> str | None:
    if 0 < d < s.policy.detect_timeout_s:
        return (f"expected 0 (no heal within the run) or at least policy.detect_timeout_s "
                f"({s.policy.detect_timeout_s:g} s): a cut that heals before it is found is a stall, "
                f"which keel does not model yet; got {d:g}")
    return None


def outlasts_detection(e: Any, s: Any) -> tuple[str, str] | None:
    """A scheduled cut's duration: it is found (by the heartbeat timeout) before it heals."""
    d = e.duration_s if e.duration_s is not None else s.faults.network_partition.duration_s
    problem = _heals_too_soon(d, s)
    return ("duration_s", problem) if problem else None


def table_outlasts_detection(table: Any, s: Any) -> tuple[str, str] | None:
    """The same for the drawn cuts (the class table's duration)."""
    problem = _heals_too_soon(table.duration_s, s) if table.per_day > 0 else None
    return ("duration_s", problem) if problem else None


def shard_number(target: str) -> int:
    """N of a data shard's target 'shard/N'."""
    return int(target.split("/")[1])


# ----------------------------------------------------------------------------- rates

def per_node_mtbf(key: str) -> Callable[[Any, int], float]:
    """Faults per second over `nodes` nodes, each failing every `key` hours on average."""
    def rate(table: Any, nodes: int) -> float:
        hours = getattr(table, key)
        return nodes / (hours * HOUR) if hours else 0.0
    return rate


def per_day(table: Any, nodes: int) -> float:
    return table.per_day / DAY


# ----------------------------------------------------------------------------- the entry

@dataclass(frozen=True, kw_only=True, slots=True)
class FaultClass:
    name: str                     # the scenario key and the events' `fault`
    table: type                   # its [faults.<name>] table
    doc: str                      # the table's line in `keel scenario --schema`
    absorb_action: str            # the action under policy absorb
    target_hint: str              # what a scheduled entry's target is, in words
    check_target: Callable[[Any, Any, Any], str | None]   # (target, entry, scenario) -> error or None
    rate_key: str                 # the table's key whose 0 turns drawn faults off
    rate_per_s: Callable[[Any, int], float]   # (table, nodes) -> drawn faults a second
    rate_label: str               # the dashboard's label for rate_key
    colour: str                   # in every chart
    injection: str                # the runtime's mode: kill | jitter | poison | coordinator | partition
    twin: str                     # module with its twin behaviour (twin/fault_kinds)
    runtime: str                  # module with its runtime behaviour (runtime/coordinator/injections)
    positive: tuple[tuple[str, bool], ...] = ()   # (table key, 0 allowed): its values' checks
    check_params: Callable[[Any, Any], tuple[str, str] | None] | None = None  # (entry, scenario) -> (key, error)
    check_table: Callable[[Any, Any], tuple[str, str] | None] | None = None   # (table, scenario) -> (key, error)
    schedule_keys: tuple[str, ...] = ()   # a schedule entry's keys that override the table's
    target_optional: bool = False  # the target may be left out (there is only one)
    has_duration: bool = False     # an episode lasts a while (it may still be open at the run's end)
    stops_job: bool = True         # under checkpoint_restart it stops the job (else the run endures it)
    fails_without_quarantine: bool = False  # with policy.quarantine = false the run fails
    node_loss: str | None = None   # nodes are lost: "kill" (one), "rack" (several), "partition" (cut off)
    shard_target: bool = False     # its target is a data shard

    def resolve(self, e: Any, faults: Any) -> tuple[str, dict[str, Any]]:
        """A schedule entry's target and parameters, the class table's where it sets none."""
        table = getattr(faults, self.name)
        kw = {k: getattr(e, k) if getattr(e, k) is not None else getattr(table, k) for k in self.schedule_keys}
        if self.shard_target:
            kw["shard"] = shard_number(e.target)
        target = e.target if e.target is not None or not self.target_optional else COORDINATOR
        return target, kw


REGISTRY: dict[str, FaultClass] = {}


def register(fc: FaultClass) -> FaultClass:
    assert fc.name not in REGISTRY, fc.name
    REGISTRY[fc.name] = fc
    return fc


register(FaultClass(
    name="hardware_fault", table=HardwareFault, doc="hardware faults (one node dies)",
    absorb_action="replicate_resume", target_hint="a node 'region/i'", check_target=node_target,
    rate_key="mtbf_node_hours", rate_per_s=per_node_mtbf("mtbf_node_hours"),
    rate_label="hardware: MTBF per node (hours, 0 = off)", colour="#d62728", injection="kill",
    twin="twin.fault_kinds.hardware_fault", runtime="runtime.coordinator.injections.hardware_fault",
    positive=(("mtbf_node_hours", True), ("repair_hours", False)), node_loss="kill"))
register(FaultClass(
    name="network_jitter", table=NetworkJitter, doc="latency spikes",
    absorb_action="backpressure_reslot", target_hint="a region name or a node 'region/i'",
    check_target=node_or_region_target, rate_key="per_day", rate_per_s=per_day,
    rate_label="network jitter: spikes per day", colour="#ff7f0e", injection="jitter",
    twin="twin.fault_kinds.network_jitter", runtime="runtime.coordinator.injections.network_jitter",
    positive=(("per_day", True), ("spike_ms", True), ("duration_s", False)),
    schedule_keys=("spike_ms", "duration_s"), has_duration=True, stops_job=False))
register(FaultClass(
    name="partial_cluster_loss", table=PartialClusterLoss, doc="several nodes of one region die at once",
    absorb_action="shard_reweight_failover", target_hint="a region name",
    check_target=region_target, check_params=rack_size,
    rate_key="per_day", rate_per_s=per_day, rate_label="partial cluster loss: events per day",
    colour="#9467bd", injection="kill",
    twin="twin.fault_kinds.partial_cluster_loss", runtime="runtime.coordinator.injections.partial_cluster_loss",
    positive=(("per_day", True), ("nodes", False), ("repair_hours", False)),
    schedule_keys=("nodes",), node_loss="rack"))
register(FaultClass(
    name="data_shard_skew", table=DataShardSkew, doc="a data shard starts yielding NaN",
    absorb_action="quarantine_resample", target_hint="'shard/N'", check_target=shard_target,
    rate_key="per_day", rate_per_s=per_day, rate_label="data shard skew: bad shards per day",
    colour="#8c564b", injection="poison",
    twin="twin.fault_kinds.data_shard_skew", runtime="runtime.coordinator.injections.data_shard_skew",
    positive=(("per_day", True),), fails_without_quarantine=True, shard_target=True))
register(FaultClass(
    name="coordinator_loss", table=CoordinatorLoss, doc="the coordinator process dies",
    # the supervisor starts a successor; the workers train on, rejoin it, and it aborts the
    # current generation and forms the next (same slot map, no one lost)
    absorb_action="coordinator_failover", target_hint=f"{COORDINATOR!r}", check_target=coordinator_target,
    rate_key="per_day", rate_per_s=per_day, rate_label="coordinator loss: deaths per day",
    colour="#e377c2", injection="coordinator",
    twin="twin.fault_kinds.coordinator_loss", runtime="runtime.coordinator.injections.coordinator_loss",
    positive=(("per_day", True),), target_optional=True))

register(FaultClass(
    name="network_partition", table=NetworkPartition, doc="a node or a region cut off from the others",
    # found only by the heartbeat timeout (no connection is reset), then absorbed as the loss of
    # its nodes: their slots spread over the other regions; a cut-off worker commits nothing
    absorb_action="shard_reweight_failover", target_hint="a region name or a node 'region/i'",
    check_target=node_or_region_target, check_params=outlasts_detection, check_table=table_outlasts_detection,
    rate_key="per_day", rate_per_s=per_day, rate_label="network partitions per day",
    colour="#17becf", injection="partition",
    twin="twin.fault_kinds.network_partition", runtime="runtime.coordinator.injections.network_partition",
    positive=(("per_day", True), ("duration_s", True), ("rejoin_hours", True)),
    schedule_keys=("duration_s",), node_loss="partition"))

FAULT_CLASSES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> FaultClass:
    """The entry of class `name`; an unknown class is an error, never another class's behaviour."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown fault class {name!r} (known: {', '.join(REGISTRY)})") from None


def classes() -> list[FaultClass]:
    return list(REGISTRY.values())


def rate_overrides(value: float = 0.0) -> dict[str, float]:
    """`{"faults.<class>.<rate_key>": value}` for every class (0: only the schedule strikes)."""
    return {f"faults.{fc.name}.{fc.rate_key}": value for fc in REGISTRY.values()}


@contextlib.contextmanager
def registered(fc: FaultClass) -> Iterator[FaultClass]:
    """`fc` registered for the duration (tests: a new class needs nothing but its entry and
    modules). The scenario's `Faults` table is rebuilt with it, and again without it after."""
    global FAULT_CLASSES
    from keel import schema
    register(fc)
    FAULT_CLASSES = tuple(REGISTRY)
    schema.rebuild_faults_table()
    try:
        yield fc
    finally:
        del REGISTRY[fc.name]
        FAULT_CLASSES = tuple(REGISTRY)
        schema.rebuild_faults_table()
