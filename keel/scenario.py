"""The scenario: one TOML file, read by the twin and the runtime alike.

Parsed once into frozen dataclasses. Unknown keys, wrong types, impossible values, links to
regions that do not exist and scheduled faults whose target does not exist are all
`ScenarioError`s: one sentence that names the file, the key and what was expected.
Precedence of values: `--set` overrides > file > the defaults documented on each field.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from keel.errors import InputError, read_input
from keel.recovery import COORDINATOR

FAULT_CLASSES = ("hardware_fault", "network_jitter", "partial_cluster_loss", "data_shard_skew",
                 "coordinator_loss")
# Bounds a scenario's values must keep, so that no figure is too large or too small for the
# twin's and the runtime's arithmetic (and no check of the scenario itself runs for ever):
INT_LIMIT = 2 ** 63 - 1          # any integer key (64 bits)
FLOAT_LIMIT = 1e12               # any number key, in magnitude ...
FLOAT_TINY = 1e-9                # ... unless 0, at least this
MAX_NODES = 100_000              # nodes in the whole cluster
MAX_STEPS = 10_000_000           # run.steps (the twin predicts about 100,000 steps a second)
MAX_SLOTS = 1_000_000            # workload.slots
MAX_SHARDS = 1_000_000           # data.shards
MAX_FAULTS_PER_S = 1.0           # drawn faults of every class over the cluster, on average
SPIKE_SPREAD = 0.25  # a latency spike's delay varies by +-this fraction of spike_ms from step to step


def spike_factor(seed: int, node: str, step: int | str) -> float:
    """A spiked node's delay at one pass of its communication path, as a multiple of
    `spike_ms`: uniform in [1 - SPIKE_SPREAD, 1 + SPIKE_SPREAD] and a pure function of
    (run seed, node, step index), so the runtime (which sleeps it before the collectives of
    0-based step `step`) and the twin (which predicts that step) see the same draw, and a
    repeated run the same delays."""
    digest = hashlib.blake2b(f"{seed}/{node}/{step}".encode(), digest_size=8).digest()
    return 1.0 - SPIKE_SPREAD + 2.0 * SPIKE_SPREAD * int.from_bytes(digest, "big") / 2.0 ** 64


def compute_factor(seed: int, node: str, step: int, cv: float) -> float:
    """A node's compute time at 0-based step `step`, as a multiple of its nominal time: a
    normal draw of mean 1 and standard deviation `cv` (`workload.compute_jitter`), clamped to
    [0.05, 1 + 6 cv]; a pure function of (run seed, node, step), so a repeated emulated run
    computes as long, step by step, and a replay of a step after a recovery as long as the
    first time. Box-Muller over two uniforms from blake2b of "seed/node/step/compute"."""
    if cv <= 0:
        return 1.0
    digest = hashlib.blake2b(f"{seed}/{node}/{step}/compute".encode(), digest_size=16).digest()
    u1 = (int.from_bytes(digest[:8], "big") + 1) / (2.0 ** 64 + 1)
    u2 = int.from_bytes(digest[8:], "big") / 2.0 ** 64
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return min(max(1.0 + cv * z, 0.05), 1.0 + 6.0 * cv)


class ScenarioError(InputError):
    """A scenario (file or override) that cannot be used; the message names file and key."""


def _doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


# ----------------------------------------------------------------------------- schema

@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    name: str = _doc("name of the run, used in reports", "keel-run")
    seed: int = _doc("seed of every random choice (fault draws, data order, weights init)", 0)
    steps: int = _doc("training steps to complete", 1000)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    step_compute_s: float = _doc("fault-free compute time of one slot's micro-batch on a node", 1.0)
    gradient_bytes: int = _doc("bytes of gradient all-reduced every step", 2_000_000_000)
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
class ScheduledFault:
    at_step: int = _doc("the fault strikes once this many steps are committed")
    class_: str = _doc("fault class: " + ", ".join(FAULT_CLASSES))
    target: str | None = _doc("region/i for a node, a region name, shard/N, or 'coordinator' "
                              "(coordinator_loss, the only class that may leave it out)", None)
    spike_ms: float | None = _doc("network_jitter: overrides faults.network_jitter.spike_ms", None)
    duration_s: float | None = _doc("network_jitter: overrides faults.network_jitter.duration_s", None)
    nodes: int | None = _doc("partial_cluster_loss: overrides faults.partial_cluster_loss.nodes", None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Faults:
    hardware_fault: HardwareFault = _doc("hardware faults (one node dies)", default_factory=HardwareFault)
    network_jitter: NetworkJitter = _doc("latency spikes", default_factory=NetworkJitter)
    partial_cluster_loss: PartialClusterLoss = _doc("several nodes of one region die at once", default_factory=PartialClusterLoss)
    data_shard_skew: DataShardSkew = _doc("a data shard starts yielding NaN", default_factory=DataShardSkew)
    coordinator_loss: CoordinatorLoss = _doc("the coordinator process dies", default_factory=CoordinatorLoss)
    schedule: tuple[ScheduledFault, ...] = _doc("deterministic injections, in both tools", ())


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
    time_scale: float = _doc("wall seconds per emulated second (0.1: the emulated cluster runs 10x faster "
                             "than the real one would)", 1.0)
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
    faults: Faults = _doc("fault profile", default_factory=Faults)
    policy: Policy = _doc("recovery policy", default_factory=Policy)
    model: Model = _doc("the runtime's model", default_factory=Model)
    data: Data = _doc("the runtime's dataset", default_factory=Data)
    validate: Validate = _doc("validation tolerances, declared before the run", default_factory=Validate)
    emulation: Emulation = _doc("the runtime's emulated-cluster mode", default_factory=Emulation)
    source: str = field(default="<scenario>", compare=False, metadata={"internal": True})

    # -- derived, never stored
    @property
    def node_names(self) -> list[str]:
        return [f"{r.name}/{i}" for r in self.regions for i in range(r.nodes)]

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
        return _to_plain(self)

    def plain(self) -> dict[str, Any]:
        """The resolved scenario as a dict `from_dict` reads back (keys set to None left out)."""
        return _strip_none(self.to_dict())

    def with_overrides(self, values: typing.Mapping[str, Any] | None = None,
                       texts: typing.Sequence[str] = ()) -> "Scenario":
        """This scenario with dotted keys set (`{"policy.hot_spares": 2}`, or `--set` texts
        such as `"run.steps=20"`), checked like a loaded file; errors name `self.source`."""
        raw = self.plain()
        for key, value in (values or {}).items():
            apply_override(raw, key, value, self.source)
        return from_dict(raw, self.source, texts)

    def config_hash(self) -> str:
        return config_hash(self)


# ----------------------------------------------------------------------------- hashing

def _strip_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_strip_none(v) for v in obj]
    return obj


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("internal"):
                continue
            out[_toml_name(f.name)] = _to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(scenario: Scenario) -> str:
    """sha256 (64 hex) of the resolved scenario in canonical JSON."""
    return hashlib.sha256(canonical_json(scenario.to_dict()).encode()).hexdigest()


def diff_configs(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable list of the keys whose values differ between two resolved scenarios."""
    changes: list[str] = []
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            key = f"{prefix}.{k}" if prefix else k
            if k not in old:
                changes.append(f"{key} added ({new[k]!r})")
            elif k not in new:
                changes.append(f"{key} removed (was {old[k]!r})")
            else:
                changes += diff_configs(old[k], new[k], key)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            changes += diff_configs(a, b, f"{prefix}.{i}")
    elif old != new:
        changes.append(f"{prefix}: {old!r} -> {new!r}")
    return changes


# ----------------------------------------------------------------------------- loading

def _toml_name(py_name: str) -> str:
    return "class" if py_name == "class_" else py_name


def _py_name(toml_name: str) -> str:
    return "class_" if toml_name == "class" else toml_name


def _unit(key: str) -> str:
    for suffix, unit in (("_ms", "milliseconds"), ("_s", "seconds"), ("_gbit_s", "Gbit/s"),
                         ("_gbyte_s", "GB/s"), ("_bytes", "bytes"), ("_hours", "hours"),
                         ("per_day", "per day")):
        if key.endswith(suffix):
            unit = "Gbit/s" if key.endswith("_gbit_s") else "GB/s" if key.endswith("_gbyte_s") else unit
            return f" ({unit})"
    return ""


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp)


class _Loader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, message: str) -> typing.NoReturn:
        where = f"key '{key}'" if key else "top level"
        raise ScenarioError(f"{self.source}: {where}: {message}")

    def build(self, cls: type, raw: Any, path: str) -> Any:
        if not isinstance(raw, dict):
            self.fail(path, f"expected a table, got {type(raw).__name__} {raw!r}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        valid = [_toml_name(n) for n in fields]
        for key in raw:
            if _py_name(key) not in fields:
                close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
                hint = f"; did you mean '{close[0]}'{_unit(close[0])}?" if close else f"; valid keys: {', '.join(valid)}"
                self.fail(f"{path}.{key}" if path else key, f"unknown key{hint}")
        kwargs = {}
        for name, f in fields.items():
            key = _toml_name(name)
            sub = f"{path}.{key}" if path else key
            if key in raw:
                kwargs[name] = self.value(hints[name], raw[key], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.fail(sub, "missing; it has no default" + _unit(key))
        return cls(**kwargs)

    def value(self, tp: Any, raw: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            if raw is None:  # an optional key left unset (to_dict writes it as null)
                return None
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            return self.value(args[0], raw, key)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, raw, key)
        if origin is tuple:
            (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
            if not isinstance(raw, list):
                self.fail(key, f"expected an array of tables, got {raw!r}")
            return tuple(self.value(item, x, f"{key}.{i}") for i, x in enumerate(raw))
        if origin is Literal:
            if raw not in typing.get_args(tp):
                self.fail(key, f"expected {_type_name(tp)}, got {raw!r}")
            return raw
        if tp is bool:
            if not isinstance(raw, bool):
                self.fail(key, f"expected true or false, got {raw!r}")
            return raw
        if tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                if not (isinstance(raw, float) and raw.is_integer()):
                    self.fail(key, f"expected an integer{_unit(key.rsplit('.', 1)[-1])}, got {raw!r}")
                raw = int(raw)
            if abs(raw) > INT_LIMIT:
                self.fail(key, f"expected an integer of at most {INT_LIMIT} in magnitude (64 bits), got {raw}")
            return raw
        if tp is float:
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                self.fail(key, f"expected a number{_unit(key.rsplit('.', 1)[-1])}, got {raw!r}")
            if isinstance(raw, int) and abs(raw) > FLOAT_LIMIT:  # also ints too large for a float
                self.fail(key, f"expected a number of at most {FLOAT_LIMIT:g} in magnitude, got {raw}")
            if not math.isfinite(raw):
                self.fail(key, f"expected a finite number, got {raw!r}")
            if raw and not FLOAT_TINY <= abs(raw) <= FLOAT_LIMIT:
                self.fail(key, f"expected 0 or a number between {FLOAT_TINY:g} and {FLOAT_LIMIT:g} in "
                               f"magnitude{_unit(key.rsplit('.', 1)[-1])}, got {raw!r}")
            return float(raw)
        if tp is str:
            if not isinstance(raw, str):
                self.fail(key, f"expected a string, got {raw!r}")
            return raw
        raise AssertionError(f"unhandled schema type {tp!r} at {key}")


# ----------------------------------------------------------------------------- overrides

def parse_override(text: str) -> tuple[str, Any]:
    """'regions.2.nodes=10' -> ('regions.2.nodes', 10). The value is read as a TOML value;
    a bare word that is not valid TOML is taken as a string."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ScenarioError(f"--set {text!r}: expected dotted.key=value")
    value = value.strip()
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key, parsed


def _is_index(text: str) -> bool:
    """A non-negative integer written in ASCII digits ('²' and '١' are digits to str.isdigit)."""
    return text.isascii() and text.isdigit()


def apply_override(raw: dict, key: str, value: Any, source: str = "<scenario>") -> None:
    parts = key.split(".")
    origin = f"(from --set {key})"
    node: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not _is_index(part) or int(part) >= len(node):
                raise ScenarioError(f"{source}: key '{here}' {origin}: expected an index below {len(node)}, got {part!r}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ScenarioError(f"{source}: key '{here}' {origin}: '{'.'.join(parts[:i])}' is not a table")
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})


# ----------------------------------------------------------------------------- checks

def _check(s: Scenario) -> None:
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
    positive(w.gradient_bytes, "workload.gradient_bytes", True)
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
    positive(f.hardware_fault.mtbf_node_hours, "faults.hardware_fault.mtbf_node_hours", True)
    positive(f.hardware_fault.repair_hours, "faults.hardware_fault.repair_hours")
    positive(f.network_jitter.per_day, "faults.network_jitter.per_day", True)
    positive(f.network_jitter.spike_ms, "faults.network_jitter.spike_ms", True)
    positive(f.network_jitter.duration_s, "faults.network_jitter.duration_s")
    positive(f.partial_cluster_loss.per_day, "faults.partial_cluster_loss.per_day", True)
    positive(f.partial_cluster_loss.nodes, "faults.partial_cluster_loss.nodes")
    positive(f.partial_cluster_loss.repair_hours, "faults.partial_cluster_loss.repair_hours")
    positive(f.data_shard_skew.per_day, "faults.data_shard_skew.per_day", True)
    positive(f.coordinator_loss.per_day, "faults.coordinator_loss.per_day", True)
    rates = {"faults.hardware_fault.mtbf_node_hours": s.total_nodes / (f.hardware_fault.mtbf_node_hours * 3600.0)
             if f.hardware_fault.mtbf_node_hours else 0.0,
             **{f"faults.{c}.per_day": getattr(f, c).per_day / 86400.0
                for c in ("network_jitter", "partial_cluster_loss", "data_shard_skew", "coordinator_loss")}}
    if sum(rates.values()) > MAX_FAULTS_PER_S:
        worst = max(rates, key=rates.get)
        fail(worst, f"expected drawn faults at most {MAX_FAULTS_PER_S:g} a second over the whole cluster on "
                    f"average, got {sum(rates.values()):.3g} a second (a fault storm no run survives)")
    nodes = set(s.node_names)
    for i, e in enumerate(f.schedule):
        key = f"faults.schedule.{i}"
        positive(e.at_step, f"{key}.at_step", True)
        if e.at_step >= s.run.steps:
            fail(f"{key}.at_step", f"expected a step below run.steps ({s.run.steps}), got {e.at_step}")
        if e.class_ not in FAULT_CLASSES:
            close = difflib.get_close_matches(e.class_, FAULT_CLASSES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            fail(f"{key}.class", f"expected one of {', '.join(FAULT_CLASSES)}, got {e.class_!r}{hint}")
        t = e.target
        if e.class_ == "coordinator_loss":
            if t not in (None, COORDINATOR):
                fail(f"{key}.target", f"expected {COORDINATOR!r} (or no target) for a coordinator_loss, got {t!r}")
        elif t is None:
            fail(f"{key}.target", f"missing; a {e.class_} needs one ({_TARGETS[e.class_]})")
        if e.class_ == "hardware_fault" and t not in nodes:
            fail(f"{key}.target", f"expected a node 'region/i' of this cluster (e.g. {s.node_names[0]!r}), got {t!r}")
        if e.class_ == "partial_cluster_loss" and t not in seen:
            fail(f"{key}.target", f"expected a region name ({', '.join(sorted(seen))}), got {t!r}")
        if e.class_ == "network_jitter" and t not in seen and t not in nodes:
            fail(f"{key}.target", f"expected a region name or a node 'region/i', got {t!r}")
        if e.class_ == "data_shard_skew":
            ok = t.startswith("shard/") and _is_index(t[6:]) and int(t[6:]) < s.data.shards
            if not ok:
                fail(f"{key}.target", f"expected 'shard/N' with N below data.shards ({s.data.shards}), got {t!r}")
        if e.nodes is not None:
            positive(e.nodes, f"{key}.nodes")
            if e.class_ == "partial_cluster_loss" and t in seen and e.nodes > s.region(t).nodes:
                fail(f"{key}.nodes", f"region {t!r} has {s.region(t).nodes} nodes, cannot lose {e.nodes}")
        if e.spike_ms is not None:
            positive(e.spike_ms, f"{key}.spike_ms", True)
        if e.duration_s is not None:
            positive(e.duration_s, f"{key}.duration_s")
    p = s.policy
    positive(p.heartbeat_s, "policy.heartbeat_s")
    positive(p.detect_timeout_s, "policy.detect_timeout_s")
    if p.detect_timeout_s < p.heartbeat_s:
        fail("policy.detect_timeout_s", f"expected at least policy.heartbeat_s ({p.heartbeat_s}), got {p.detect_timeout_s}")
    for table in ("hardware_fault", "partial_cluster_loss"):
        repair_s = getattr(f, table).repair_hours * 3600.0
        if repair_s < p.detect_timeout_s:
            fail(f"faults.{table}.repair_hours", f"expected a repair no shorter than policy.detect_timeout_s "
                 f"({p.detect_timeout_s:g} s): a node is repaired after it is found lost, got "
                 f"{getattr(f, table).repair_hours:g} h ({repair_s:g} s)")
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
    if s.data.shards > MAX_SHARDS:
        fail("data.shards", f"expected at most {MAX_SHARDS:,} shards, got {s.data.shards:,}")
    positive(s.validate.downtime_rel_tol, "validate.downtime_rel_tol")
    positive(s.validate.wall_rel_tol, "validate.wall_rel_tol")
    positive(s.validate.repetitions, "validate.repetitions")
    positive(s.validate.fault_rel_tol, "validate.fault_rel_tol")
    positive(s.validate.steps, "validate.steps", True)
    positive(s.emulation.time_scale, "emulation.time_scale")
    if not 0.0 <= s.emulation.max_overrun_fraction <= 1.0:
        fail("emulation.max_overrun_fraction", f"expected a fraction in [0, 1], got {s.emulation.max_overrun_fraction!r}")


_TARGETS = {"hardware_fault": "a node 'region/i'", "partial_cluster_loss": "a region name",
            "network_jitter": "a region name or a node 'region/i'", "data_shard_skew": "'shard/N'"}


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


# ----------------------------------------------------------------------------- entry points

def from_dict(raw: dict, source: str = "<scenario>", overrides: typing.Sequence[str] = ()) -> Scenario:
    raw = copy.deepcopy(raw)  # overrides must not touch the caller's dict
    for text in overrides:
        key, value = parse_override(text)
        apply_override(raw, key, value, source)
    scenario = _Loader(source).build(Scenario, raw, "")
    scenario = dataclasses.replace(scenario, source=source)
    _check(scenario)
    return scenario


def load(path: str | Path, overrides: typing.Sequence[str] = ()) -> Scenario:
    path = Path(path)
    return loads(read_input(path, "scenario", ScenarioError), str(path), overrides)


def loads(text: str, source: str = "<scenario>", overrides: typing.Sequence[str] = ()) -> Scenario:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{source}: TOML syntax error: {e}") from None
    return from_dict(raw, source, overrides)


def dumps(scenario: Scenario) -> str:
    """The resolved scenario as TOML (every key, defaults included)."""
    return _toml_dump(scenario.to_dict())


def override_text(key: str, value: Any) -> str:
    """`key=value` as `--set` takes it (parse_override reads it back)."""
    return f"{key}={toml_value(value)}"


def toml_value(v: Any) -> str:
    """A scalar as TOML writes it (what `--set key=VALUE` reads back)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise AssertionError(v)


def _toml_dump(d: dict, prefix: str = "") -> str:
    lines: list[str] = []
    scalars = {k: v for k, v in d.items() if not isinstance(v, (dict, list)) and v is not None}
    if scalars and prefix:
        lines.append(f"[{prefix}]")
    for k, v in scalars.items():
        lines.append(f"{k} = {toml_value(v)}")
    if scalars:
        lines.append("")
    for k, v in d.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            lines.append(_toml_dump(v, name))
        elif isinstance(v, list):
            for item in v:
                lines.append(f"[[{name}]]")
                lines += [f"{ik} = {toml_value(iv)}" for ik, iv in item.items() if iv is not None]
                lines.append("")
    return "\n".join(lines)


def describe_schema(cls: type = Scenario, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every key, for the README and `keel` help."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}.{_toml_name(f.name)}" if prefix else _toml_name(f.name)
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            rows += describe_schema(tp, key)
        elif inner:
            rows += describe_schema(inner[0], key + "[]")
        else:
            default = "required" if f.default is dataclasses.MISSING else repr(f.default)
            rows.append((key, default, f.metadata.get("doc", "")))
    return rows


def cli_show(args: Any) -> int:
    """`keel scenario [FILE] [--set k=v] [--schema]`: the resolved scenario as TOML, or the schema."""
    if args.schema:
        rows = describe_schema()
        width = max(len(k) for k, _, _ in rows)
        for key, default, doc in rows:
            print(f"{key:<{width}}  {default:<14}  {doc}")
        return 0
    print(f"# {args.loaded.source}, resolved; config hash {args.loaded.config_hash()}")
    print(dumps(args.loaded))
    return 0
