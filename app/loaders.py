"""Reading a run, validation or plan directory as untrusted input. Whatever is wrong with
a file (not UTF-8, not JSON, NaN or Infinity where keel writes none, a key of the wrong type)
is an `InputError` naming the file, the line or key, and the reason: the dashboard shows the
run as damaged with it, `keel report` prints it as one line. An event log is read once,
line by line, and kept summarised (`RunLog`): every event but the committed steps, and the
steps thinned to at most MAX_STEP_POINTS, so a long run's log costs what its faults cost."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from keel import metrics, rundir
from keel.errors import InputError
from keel.events import Event, EventLogError, validate_event

MAX_STEP_POINTS = 2000      # committed steps kept from a long log (every k-th, and the first after each event)
MAX_OTHER_EVENTS = 50_000   # events other than steps kept; beyond: the log is damaged (no run has that many)
_STEP = b'"kind":"step"'
_CONSTANT = re.compile(r"(?<![\w\"])-?(NaN|Infinity)(?![\w\"])")


def _refuse_constant(name: str) -> Any:
    raise ValueError(name)


def read_json(path: str | Path) -> Any:
    """A JSON file keel wrote: UTF-8, strict JSON (no NaN or Infinity: keel writes none)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not UTF-8 text") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except ValueError as e:
        m = _CONSTANT.search(text)
        line = text[:m.start()].count("\n") + 1 if m else "?"
        raise InputError(f"{path}:{line}: {e} is not a JSON number (keel writes no NaN or Infinity)") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to be a file keel wrote") from None


# ----------------------------------------------------------------------------- summary.json

def _number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _count(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


_SUMMARY_NUMBERS = ("wall_s", "step_time_s", "goodput")
_SUMMARY_COUNTS = ("steps", "restarts")
_FAULT_NUMBERS = ("t", "downtime_s", "cost_s")
_FAULT_COUNTS = ("at_step", "lost_steps")
_FAULT_TEXTS = ("class", "target", "action")


def check_summary(summary: Any, where: str) -> dict[str, Any]:
    """`summary` if every key the dashboard and the report read has its documented type;
    an InputError naming the key otherwise."""
    if not isinstance(summary, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(summary).__name__}")

    def bad(key: str, expected: str, got: Any) -> InputError:
        return InputError(f"{where}: key '{key}': expected {expected}, got {json.dumps(got)[:60]}")
    for key in _SUMMARY_NUMBERS:
        if not _number(summary.get(key)):
            raise bad(key, "a number", summary[key])
    for key in _SUMMARY_COUNTS:
        if not _count(summary.get(key)):
            raise bad(key, "an integer", summary[key])
    for key in ("scenario", "tool"):
        if summary.get(key) is not None and not isinstance(summary[key], str):
            raise bad(key, "a string", summary[key])
    faults = summary.get("faults", [])
    if not isinstance(faults, list):
        raise bad("faults", "a list of fault objects", faults)
    for i, f in enumerate(faults):
        if not isinstance(f, dict):
            raise bad(f"faults.{i}", "a fault object", f)
        for key, ok, what in ([(k, _number, "a number") for k in _FAULT_NUMBERS]
                              + [(k, _count, "an integer") for k in _FAULT_COUNTS]
                              + [(k, lambda v: v is None or isinstance(v, str), "a string") for k in _FAULT_TEXTS]):
            if not ok(f.get(key)):
                raise bad(f"faults.{i}.{key}", what, f[key])
        if not isinstance(f.get("fault_id"), (int, str, type(None))) or isinstance(f.get("fault_id"), bool):
            raise bad(f"faults.{i}.fault_id", "an integer", f["fault_id"])
    losses = summary.get("losses", [])
    if not isinstance(losses, list) or not all(_number(x) for x in losses):
        raise bad("losses", "a list of numbers", losses)
    for key in ("emulation", "pass"):
        if summary.get(key) is not None and not isinstance(summary[key], dict):
            raise bad(key, "an object", summary[key])
    return summary


def read_run_summary(path: str | Path) -> dict[str, Any]:
    file = Path(path) / rundir.SUMMARY
    return check_summary(read_json(file), str(file))


# ----------------------------------------------------------------------------- events.jsonl

class RunLog(list):
    """A run's events, summarised: every event but committed steps, and the steps thinned to
    at most about MAX_STEP_POINTS (each first step after another event kept: a fault's
    downtime ends there). `lines` and `steps` count what the file holds."""
    lines = 0
    steps = 0
    stride = 1


def read_run_log(path: str | Path) -> RunLog:
    """events.jsonl, read once, line by line. Every line kept is validated against the schema;
    a step line thinned out is checked to be UTF-8 text only (it is not shown). Damage is an
    EventLogError naming the file and line."""
    path = Path(path)
    out = RunLog()
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise EventLogError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        head = f.read(1 << 16)
        f.seek(0)
        per_line = max(40, len(head) // max(1, head.count(b"\n")))
        out.stride = stride = max(1, size // per_line // MAX_STEP_POINTS)
        steps = others = n = 0
        keep_next = True
        last_step = None
        for n, raw in enumerate(f, 1):
            step_line = _STEP in raw
            if step_line and not keep_next and steps % stride:
                steps += 1
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise EventLogError(f"{path}:{n}: not UTF-8 text") from None
                last_step = (n, raw)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise EventLogError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise EventLogError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise EventLogError(f"{path}:{n}: nested too deeply to be an event") from None
            event = validate_event(d, f"{path}:{n}")
            if event.kind == "step":
                steps += 1
                keep_next = False
                last_step = None
            else:
                others += 1
                if others > MAX_OTHER_EVENTS:
                    raise EventLogError(f"{path}:{n}: more than {MAX_OTHER_EVENTS:,} events other than steps; "
                                        f"not a log keel writes")
                keep_next = True
                if last_step is not None:  # the step before an event: where its episode starts
                    out.append(_step_event(path, *last_step))
                    last_step = None
            out.append(event)
        out.lines, out.steps = n, steps
    if last_step is not None:
        out.append(_step_event(path, *last_step))
    return out


def _step_event(path: Path, n: int, raw: bytes) -> Event:
    try:
        return validate_event(json.loads(raw), f"{path}:{n}")
    except json.JSONDecodeError as e:
        raise EventLogError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def load_run(path: str | Path) -> tuple[list[Event], dict[str, Any]]:
    """events.jsonl (summarised: `read_run_log`) and summary.json of a `keel simulate` /
    `keel run` directory (a run cut short before its summary was written: the summary
    computed from its events)."""
    path = Path(path)
    if not (path / rundir.EVENTS).is_file():
        raise InputError(f"{path}: expected a run directory with {rundir.EVENTS} and {rundir.SUMMARY}")
    events = read_run_log(path / rundir.EVENTS)
    if (path / rundir.SUMMARY).is_file():
        summary = read_run_summary(path)
    elif not events:
        raise InputError(f"{path / rundir.EVENTS}: no events (and no {rundir.SUMMARY})")
    else:
        summary = metrics.summarize(events)
    return events, summary


def load_comparison(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    comparison = read_json(path / "comparison.json")
    if not isinstance(comparison, dict):
        raise InputError(f"{path / 'comparison.json'}: expected a JSON object")
    for key, kind in (("faults", list), ("tolerances", dict)):
        if key not in comparison:
            raise InputError(f"{path / 'comparison.json'}: missing key '{key}'")
        if not isinstance(comparison[key], kind):
            raise InputError(f"{path / 'comparison.json'}: key '{key}': expected a {kind.__name__}")
    if not all(isinstance(f, dict) for f in comparison["faults"]):
        raise InputError(f"{path / 'comparison.json'}: key 'faults': expected a list of objects")
    return comparison


def load_plan(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "plan.json" if path.is_dir() else path
    plan = read_json(file)
    if not isinstance(plan, dict) or not isinstance(plan.get("trials"), list):
        raise InputError(f"{file}: expected a plan.json with 'trials', 'pareto', 'recommended' and 'baseline'")
    return plan


# ----------------------------------------------------------------------------- cached wrappers
# The key is the path and each file's size and modification time: a rewritten or grown file
# is read again, an unchanged one never (a 200 MB log is summarised once).

def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, 0)
    return (st.st_size, st.st_mtime_ns)


def _cached(func: Any, max_entries: int) -> Any:
    import streamlit as st
    return st.cache_data(max_entries=max_entries, show_spinner=False)(func)


def _run_cached(path: str, _stamps: tuple) -> tuple[list[Event], dict[str, Any]]:
    return load_run(path)


def _comparison_cached(path: str, _stamps: tuple) -> dict[str, Any]:
    return load_comparison(path)


def _plan_cached(path: str, _stamps: tuple) -> dict[str, Any]:
    return load_plan(path)


_wrappers: dict[str, Any] = {}


def cached_run(path: str | Path) -> tuple[list[Event], dict[str, Any]]:
    f = _wrappers.setdefault("run", _cached(_run_cached, 16))
    p = Path(path)
    return f(str(path), (_stamp(p / rundir.EVENTS), _stamp(p / rundir.SUMMARY)))


def cached_comparison(path: str | Path) -> dict[str, Any]:
    f = _wrappers.setdefault("comparison", _cached(_comparison_cached, 8))
    return f(str(path), (_stamp(Path(path) / "comparison.json"),))


def cached_plan(path: str | Path) -> dict[str, Any]:
    f = _wrappers.setdefault("plan", _cached(_plan_cached, 8))
    p = Path(path)
    return f(str(path), (_stamp(p / "plan.json" if p.is_dir() else p),))
