"""The scenario's schema: frozen dataclasses, one per table, each field with its default and
the line `keel scenario --schema` prints. The fault classes' tables come from the registry
(keel.fault_classes); loading and checking are keel/scenario_load.py's and
keel/scenario_check.py's, the entry points keel/scenario.py's."""
from __future__ import annotations

import dataclasses
import hashlib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from keel import fault_classes
from keel.scenario_base import _doc, _toml_name, canonical_json
from keel.wire import Reduction


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    name: str = _doc("name of the run, used in reports", "keel-run")
    seed: int = _doc("seed of every random choice (fault draws, data order, weights init)", 0)
    steps: int = _doc("training steps to complete", 1000)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    step_compute_s: float = _doc("fault-free compute time of one slot's micro-batch on a node", 1.0)
    params: int = _doc("the model's parameters: the gradient elements all-reduced every step (keel/wire.py "
                       "turns them into bytes with reduction.format)", 1_000_000_000)
    gradient_dtype: str = _doc("the model's gradient dtype: float32, bf16 or fp16", "bf16")
    slots: int = _doc("logical data-parallel units, fixed for the run; 0 = one per training node", 0)
    micro_batch: int = _doc("samples per slot per step", 8)
    compute_jitter: float = _doc("per-node, per-step compute jitter (coefficient of variation)", 0.02)


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    interval_steps: int = _doc("steps between checkpoints", 100)
    mode: Literal["async", "sync"] = _doc("sync blocks for the write; async snapshots then writes in the background", "async")
    weights_bytes: int = _doc("bytes of model weights in a checkpoint", 1_000_000_000)
    optimizer_bytes: int = _doc("bytes of optimizer state in a checkpoint", 2_000_000_000)
    write_gbyte_s: float = _doc("per-node checkpoint write bandwidth, GB/s", 2.0)
    read_gbyte_s: float = _doc("per-node checkpoint read bandwidth, GB/s", 4.0)
    snapshot_gbyte_s: float = _doc("per-node device-to-host snapshot bandwidth for async mode, GB/s", 20.0)
    keep: int = _doc("complete checkpoints kept on disk (the newest K)", 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    name: str = _doc("region name, unique")
    nodes: int = _doc("nodes in the region")
    gpus_per_node: int = _doc("GPUs per node (capacity is `speed`: a node computes a slot in "
                                 "step_compute_s / speed whatever its GPU count)", 8)
    intra_gbit_s: float = _doc("per-node bandwidth inside the region, Gbit/s", 400.0)
    intra_latency_ms: float = _doc("one-way latency between two nodes of the region, ms", 0.01)
    speed: float = _doc("relative compute speed of the region's nodes (1.0 = nominal)", 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    a: str = _doc("region at one end")
    b: str = _doc("region at the other end")
    rtt_ms: float = _doc("round-trip time, ms", 50.0)
    gbit_s: float = _doc("bandwidth of the link, Gbit/s", 100.0)
    jitter_ms: float = _doc("standard deviation of the one-way latency, ms", 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledFault:
    at_step: int = _doc("the fault strikes once this many steps are committed")
    class_: str = _doc("fault class: " + ", ".join(fault_classes.FAULT_CLASSES))
    target: str | None = _doc("region/i for a node, a region name, shard/N, or 'coordinator' "
                              "(coordinator_loss, the only class that may leave it out)", None)
    spike_ms: float | None = _doc("network_jitter: overrides faults.network_jitter.spike_ms", None)
    duration_s: float | None = _doc("network_jitter, network_partition: overrides the class table's duration_s", None)
    nodes: int | None = _doc("partial_cluster_loss: overrides faults.partial_cluster_loss.nodes", None)


def faults_table() -> type:
    """The `[faults]` table: one sub-table per registered class (keel.fault_classes), then the
    schedule."""
    fields = [(fc.name, fc.table, _doc(fc.doc, default_factory=fc.table)) for fc in fault_classes.classes()]
    fields.append(("schedule", tuple[ScheduledFault, ...], _doc("deterministic injections, in both tools", ())))
    table = dataclasses.make_dataclass("Faults", fields, frozen=True, kw_only=True, slots=True)
    table.__module__ = __name__
    table.__doc__ = "The fault profile: each class's drawn rate and parameters, and the schedule."
    return table


Faults = faults_table()


def rebuild_faults_table() -> None:
    """Regenerate `Faults` from the registry (keel.fault_classes.registered, for tests)."""
    global Faults
    Faults = faults_table()
    import keel.scenario
    keel.scenario.Faults = Faults


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    kind: Literal["absorb", "checkpoint_restart"] = _doc("absorb faults in place, or stop and restart from the last checkpoint", "absorb")
    heartbeat_s: float = _doc("interval between worker heartbeats, s", 1.0)
    detect_timeout_s: float = _doc("silence after which a worker is declared lost, s", 5.0)
    hot_spares: int = _doc("idle nodes kept ready to take over slots", 0)
    restart_s: float = _doc("checkpoint_restart: relaunch and rendezvous time, s", 120.0)
    replace_node_s: float = _doc("checkpoint_restart: time to get a replacement node when no spare is left, s", 600.0)
    coordinator_restart_s: float = _doc("from a coordinator's death until its successor has loaded the state and "
                                        "every worker has rejoined it (the next generation is announced), s", 1.0)
    straggler_factor: float = _doc("a worker slower than this times the median is a straggler", 1.5)
    straggler_window: int = _doc("consecutive slow steps before a straggler's slots move", 3)
    quarantine: bool = _doc("quarantine a shard that yields non-finite values and replace its "
                                "samples; false: such a shard stops the run (failed)", True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    d_model: int = _doc("the runtime model's width", 64)
    layers: int = _doc("transformer blocks", 2)
    heads: int = _doc("attention heads", 4)
    context: int = _doc("tokens per sample", 64)
    lr: float = _doc("AdamW learning rate", 1e-3)
    weight_decay: float = _doc("AdamW weight decay", 0.01)


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    entry: str = _doc("the training job: 'package.module:factory' or 'path/to/file.py:factory' (a path "
                      "relative to the scenario's directory); the factory returns a runtime.job.Job "
                      "(docs/job-api.md). Empty: the built-in byte-level GPT of [model] and [data]", "")
    config: dict[str, Any] = _doc("passed to each of the job's builders ([job.config]); enters the config hash",
                                  default_factory=dict, hash=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class Data:
    shards: int = _doc("shards the versioned dataset is cut into", 16)


@dataclass(frozen=True, kw_only=True, slots=True)
class Validate:
    downtime_rel_tol: float = _doc("median relative error allowed on per-fault downtime", 0.10)
    fault_rel_tol: float = _doc("relative error allowed on every single fault's downtime", 0.15)
    wall_rel_tol: float = _doc("relative error allowed on wall time", 0.05)
    repetitions: int = _doc("emulated runtime repetitions per validation", 2)
    steps: int = _doc("training steps of each validation run, runtime and twin (0: run.steps); every "
                      "scheduled fault must strike before the last", 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Emulation:
    enabled: bool = _doc("the runtime emulates the cluster this scenario describes on one machine "
                         "(one worker per node; compute, network, storage and detection take the "
                         "scenario's times, multiplied by time_scale); `keel run --emulate`", False)
    time_scale: float | Literal["auto"] = _doc(
        "wall seconds per emulated second (0.1: the emulated cluster runs 10x faster than the real one "
        "would); \"auto\": the smallest this machine keeps, measured before the run (keel/capacity.py)", 1.0)
    max_overrun_fraction: float = _doc("largest fraction of a run's step reports whose real work outran "
                                       "its emulated time for the run to count as a faithful emulation "
                                       "(a validation beyond it is invalid)", 0.02)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    run: Run = _doc("the run", default_factory=Run)
    workload: Workload = _doc("what one step costs", default_factory=Workload)
    checkpoint: Checkpoint = _doc("checkpoint policy and costs", default_factory=Checkpoint)
    regions: tuple[Region, ...] = _doc("the cluster's regions")
    links: tuple[Link, ...] = _doc("links between regions", ())
    faults: Faults = _doc("fault profile", default_factory=lambda: Faults())
    policy: Policy = _doc("recovery policy", default_factory=Policy)
    model: Model = _doc("the runtime's model", default_factory=Model)
    data: Data = _doc("the runtime's dataset", default_factory=Data)
    job: Job = _doc("the runtime's training job (absent: the built-in GPT)", default_factory=Job,
                    metadata_extra={"omit_default": True})
    validate: Validate = _doc("validation tolerances, declared before the run", default_factory=Validate)
    emulation: Emulation = _doc("the runtime's emulated-cluster mode", default_factory=Emulation)
    reduction: Reduction = _doc("the runtime's exact reduction over slots", default_factory=Reduction)
    source: str = field(default="<scenario>", compare=False, metadata={"internal": True})

    # -- derived, never stored
    @property
    def node_names(self) -> list[str]:
        return [f"{r.name}/{i}" for r in self.regions for i in range(r.nodes)]

    @property
    def node_speeds(self) -> dict[str, float]:
        """Each node's compute speed: its region's."""
        return {f"{r.name}/{i}": r.speed for r in self.regions for i in range(r.nodes)}

    @property
    def total_nodes(self) -> int:
        return sum(r.nodes for r in self.regions)

    @property
    def training_nodes(self) -> int:
        return self.total_nodes - self.policy.hot_spares

    @property
    def slot_count(self) -> int:
        return self.workload.slots or self.training_nodes

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def plain(self) -> dict[str, Any]:
        """The resolved scenario as a dict `from_dict` reads back (keys set to None left out)."""
        return _strip_none(self.to_dict())

    def with_overrides(self, values: typing.Mapping[str, Any] | None = None,
                       texts: typing.Sequence[str] = ()) -> "Scenario":
        """This scenario with dotted keys set (`{"policy.hot_spares": 2}`, or `--set` texts
        such as `"run.steps=20"`), checked like a loaded file; errors name `self.source`."""
        from keel.scenario_load import apply_override, from_dict
        raw = self.plain()
        for key, value in (values or {}).items():
            apply_override(raw, key, value, self.source)
        return from_dict(raw, self.source, texts)

    def config_hash(self) -> str:
        """sha256 (64 hex) of the resolved scenario in canonical JSON."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()


def _strip_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_strip_none(v) for v in obj]
    return obj


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts and lists, under its TOML key names."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("internal"):
                continue
            if f.metadata.get("omit_default") and getattr(obj, f.name) == f.default_factory():
                continue  # a table added after scenarios were hashed: absent when unused, so old hashes hold
            out[_toml_name(f.name)] = to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, tuple):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
