"""Reading a scenario: the TOML loader (types checked against the schema, unknown keys
named with a close match), `--set` overrides, and writing it back as TOML."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from keel.errors import read_input
from keel.scenario_base import (FLOAT_LIMIT, FLOAT_TINY, INT_LIMIT, ScenarioError, _is_index, _py_name,
                                _toml_name, _unit)
from keel import schema
from keel.schema import Scenario
from keel.wire import migrate as migrate_wire


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
            words = [a for a in args if typing.get_origin(a) is Literal]
            if words and len(args) > 1:  # a number or a word (`emulation.time_scale = "auto"`)
                if isinstance(raw, str):
                    if raw in typing.get_args(words[0]):
                        return raw
                    self.fail(key, f"expected {' or '.join(_type_name(a) for a in args)}, got {raw!r}")
                args = [a for a in args if a not in words]
            return self.value(args[0], raw, key)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, raw, key)
        if origin is tuple:
            (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
            if not isinstance(raw, list):
                self.fail(key, f"expected an array of tables, got {raw!r}")
            return tuple(self.value(item, x, f"{key}.{i}") for i, x in enumerate(raw))
        if origin is dict:  # a free table ([job.config]): any TOML values, kept as given
            if not isinstance(raw, dict):
                self.fail(key, f"expected a table, got {raw!r}")
            try:
                json.dumps(raw, allow_nan=False)
            except (TypeError, ValueError) as e:
                self.fail(key, f"expected plain TOML values (no dates, no nan/inf): {e}")
            return copy.deepcopy(raw)
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


# ----------------------------------------------------------------------------- entry points

def from_dict(raw: dict, source: str = "<scenario>", overrides: typing.Sequence[str] = ()) -> Scenario:
    from keel.scenario_check import check
    raw = copy.deepcopy(raw)  # overrides must not touch the caller's dict
    for text in overrides:
        key, value = parse_override(text)
        apply_override(raw, key, value, source)
    migrate_wire(raw, source, _Loader(source).fail)
    scenario = _Loader(source).build(schema.Scenario, raw, "")
    scenario = dataclasses.replace(scenario, source=source)
    check(scenario)
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
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise AssertionError(v)


def _toml_dump(d: dict, prefix: str = "") -> str:
    lines: list[str] = []
    def is_scalar(v: Any) -> bool:  # an array of values (not of tables) is written inline
        return not isinstance(v, (dict, list)) or (isinstance(v, list) and not any(isinstance(x, dict) for x in v))
    scalars = {k: v for k, v in d.items() if is_scalar(v) and v is not None}
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
        elif isinstance(v, list) and not is_scalar(v):
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
            if f.default is not dataclasses.MISSING:
                default = repr(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = repr(f.default_factory())
            else:
                default = "required"
            rows.append((key, default, f.metadata.get("doc", "")))
    return rows


