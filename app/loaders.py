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
from keel.events import Event, EventLogError, parse_line

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


# ----------------------------------------------------------------------------- shapes
# What the dashboard and the report read of each JSON file, and its type. A key may be absent
# or null unless its name starts with "!"; a nested object may not be null unless it ends with
# "?"; ("list", item, n) is a list of at least n items (of which null ones are skipped where a
# fourth element says why). Keys not named are not read.

NUM, INT, STR, BOOL, SCALAR = "number", "integer", "string", "true or false", "a scalar"
_ID = (INT, STR)

FAULT = {"!fault_id": _ID, "class": STR, "target": STR, "action": STR, "at_step": INT, "t": NUM,
         "!downtime_s": NUM, "cost_s": NUM, "lost_steps": INT}
SUMMARY = {"wall_s": NUM, "step_time_s": NUM, "goodput": NUM, "steps": INT, "restarts": INT, "scenario": STR,
           "tool": STR, "faults": ("list", FAULT, 0), "losses": ("list", NUM, 0), "goodput_ci95": ("list", NUM, 2),
           "emulation?": {"reports": INT, "overruns": INT, "overrun_fraction": NUM, "max_overrun_fraction": NUM,
                          "faithful": BOOL, "time_scale": NUM}}
COMPARISON = {
    "scenario": STR, "repetitions": INT, "config_hash": STR, "calibration": STR, "downtime_median_rel_err": NUM,
    "!tolerances": {"downtime_rel_tol": NUM, "fault_rel_tol": NUM, "wall_rel_tol": NUM},
    "emulation": ("list", {"reports": INT, "overruns": INT, "max_overrun_fraction": NUM, "faithful": BOOL}, 0,
                  "null: a repetition not emulated"),
    "!faults": ("list", {"fault_id": _ID, "class": STR, "target": STR, "downtime_rel_err": NUM,
                         "predicted": {"downtime_s": NUM, "downtime_ci95": ("list", NUM, 2)},
                         "observed": {"downtime_s": NUM, "downtime_s_reps": ("list", NUM, 0, "null: not seen in a repetition")}}, 0),
    "wall_s?": {"predicted": NUM, "observed": NUM, "rel_err": NUM, "launch_s_reps": ("list", NUM, 0, "null: not measured")},
    "goodput?": {"predicted": NUM, "observed": NUM, "rel_err": NUM},
    "pass": {"downtime": BOOL, "each_fault": BOOL, "wall": BOOL, "valid": BOOL, "all": BOOL}}
_CHOSEN = {"number": INT, "goodput": NUM, "cost_node_hours_per_step": NUM}
PLAN = {"scenario": STR, "rule": STR, "replicas": INT, "recommended?": _CHOSEN, "baseline?": _CHOSEN,
        "!trials": ("list", {"number": INT, "!goodput": NUM, "goodput_ci95": ("list", NUM, 2),
                             "!cost_node_hours_per_step": NUM, "source": STR, "policy": {"*": SCALAR}}, 0),
        "pareto": ("list", {"number": INT}, 0), "improvement?": {"cost_ratio": NUM},
        "interval_refinement?": {"fitted": INT}}


def _is(value: Any, kind: str) -> bool:
    if kind == BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return kind == SCALAR
    return {NUM: isinstance(value, (int, float)), INT: isinstance(value, int), STR: isinstance(value, str),
            SCALAR: isinstance(value, (int, float, str))}[kind]


def conform(value: Any, shape: Any, where: str, key: str = "") -> None:
    """InputError naming `where` and the dotted key whose value does not have the shape."""
    def bad(expected: str) -> InputError:
        return InputError(f"{where}: {f'key {key!r}: ' if key else ''}expected {expected}, "
                          f"got {json.dumps(value)[:60]}")
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise bad("an object")
        for name, sub in shape.items():
            required, nullable = name.startswith("!"), name.endswith("?")
            name = name.strip("!?")
            items = value.items() if name == "*" else [(name, value.get(name))]
            for k, v in items:
                if v is None and name != "*":  # a value under "*" is never null
                    if required:
                        raise InputError(f"{where}: missing key '{f'{key}.' if key else ''}{k}'")
                    if k in value and isinstance(sub, (dict, tuple)) and not nullable:
                        conform(v, sub, where, f"{key}.{k}" if key else k)
                    continue
                conform(v, sub, where, f"{key}.{k}" if key else k)
    elif isinstance(shape, tuple) and shape[0] == "list":
        _, item, least, *nulls = shape
        if not isinstance(value, list) or len(value) < least:
            raise bad(f"a list{f' of at least {least}' if least else ''}")
        for n, v in enumerate(value):
            if v is None and nulls:
                continue
            conform(v, item, where, f"{key}.{n}")
    elif isinstance(shape, tuple):
        if not any(_is(value, k) for k in shape):
            raise bad(" or ".join(f"a {k}" for k in shape))
    elif not _is(value, shape):
        raise bad(shape if shape in (BOOL, SCALAR) else f"a {shape}")


def check_summary(summary: Any, where: str) -> dict[str, Any]:
    """`summary` if every key the dashboard and the report read has its documented type."""
    conform(summary, SUMMARY, where)
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
            event = parse_line(raw, f"{path}:{n}")
            if event is None:
                continue
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
                    out.append(parse_line(last_step[1], f"{path}:{last_step[0]}"))
                    last_step = None
            out.append(event)
        out.lines, out.steps = n, steps
    if last_step is not None:
        out.append(parse_line(last_step[1], f"{path}:{last_step[0]}"))
    return out


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
    file = Path(path) / "comparison.json"
    comparison = read_json(file)
    conform(comparison, COMPARISON, str(file))
    return comparison


def load_plan(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "plan.json" if path.is_dir() else path
    plan = read_json(file)
    if not isinstance(plan, dict) or "trials" not in plan:
        raise InputError(f"{file}: expected a plan.json with 'trials', 'pareto', 'recommended' and 'baseline'")
    conform(plan, PLAN, str(file))
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
