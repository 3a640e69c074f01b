"""What the scenario's modules share: the error, the field helper, the bounds every value
keeps, the TOML <-> Python key names and canonical JSON. Standard library only."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from typing import Any

from keel.errors import InputError

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


class ScenarioError(InputError):
    """A scenario (file or override) that cannot be used; the message names file and key."""


def _doc(text: str, default: Any = dataclasses.MISSING, metadata_extra: dict | None = None, **kw: Any) -> Any:
    metadata = {"doc": text, **(metadata_extra or {})}
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def canonical_json(obj: Any) -> str:
    """The one JSON form that hashes are taken of (config hash, dataset version)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


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


def _is_index(text: str) -> bool:
    """A non-negative integer written in ASCII digits ('²' and '١' are digits to str.isdigit)."""
    return text.isascii() and text.isdigit()


def region_of(node: str) -> str:
    """The region of a node named 'region/i' (region names have no '/')."""
    return node.rsplit("/", 1)[0]


def is_node(target: str) -> bool:
    """Whether a fault's target names a node ('region/i') rather than a region."""
    return "/" in target
