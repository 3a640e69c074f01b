"""The scenario: one TOML file, read by the twin and the runtime alike.

Parsed once into frozen dataclasses. Unknown keys, wrong types, impossible values, links to
regions that do not exist and scheduled faults whose target does not exist are all
`ScenarioError`s: one sentence that names the file, the key and what was expected.
Precedence of values: `--set` overrides > file > the defaults documented on each field.

This module is the scenario's public face; the parts live beside it:
    scenario_base.py   the error, field helper, bounds, key names, canonical JSON
    schema.py          the dataclasses (the fault tables come from keel/fault_classes.py)
    scenario_load.py   the TOML loader, overrides, TOML output, the schema's description
    scenario_check.py  every rule beyond the types
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

from keel.errors import InputError  # noqa: F401  (keel.scenario.InputError: what callers catch)
from keel.fault_classes import (COORDINATOR, CoordinatorLoss, DataShardSkew, FAULT_CLASSES,  # noqa: F401
                                HardwareFault, NetworkJitter, PartialClusterLoss)
from keel.scenario_base import (FLOAT_LIMIT, FLOAT_TINY, INT_LIMIT, MAX_FAULTS_PER_S, MAX_NODES,  # noqa: F401
                                MAX_SHARDS, MAX_SLOTS, MAX_STEPS, ScenarioError, _doc, _is_index, _py_name,
                                _toml_name, _unit, canonical_json, is_node, region_of)
from keel.scenario_check import check as _check  # noqa: F401
from keel.scenario_load import (_Loader, _toml_dump, _type_name, apply_override, describe_schema,  # noqa: F401
                                dumps, from_dict, load, loads, override_text, parse_override, toml_value)
from keel.schema import (Checkpoint, Data, Emulation, Faults, Job, Link, Model, Policy, Region, Run,  # noqa: F401
                         Scenario, ScheduledFault, Validate, Workload, _strip_none)
from keel.schema import to_plain as _to_plain  # noqa: F401

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


def compute_factor_range(cv: float) -> tuple[float, float]:
    """The least and the most `compute_factor` can draw at `cv`: its clamp, and below, the
    largest |z| Box-Muller can make from u1 >= 1 / (2^64 + 1), sqrt(2 ln(2^64 + 1)) ~ 9.42."""
    if cv <= 0:
        return 1.0, 1.0
    return max(0.05, 1.0 - math.sqrt(2.0 * math.log(2.0 ** 64 + 1)) * cv), 1.0 + 6.0 * cv


def config_hash(scenario: Scenario) -> str:
    """sha256 (64 hex) of the resolved scenario in canonical JSON."""
    return scenario.config_hash()


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
