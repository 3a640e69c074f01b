"""A run directory (`keel simulate --out`, `keel run --out`, a validation's sub-runs):
`events.jsonl` and `summary.json`, written and read in one place, and the one way every tool
prints a JSON object on stdout (`--json`)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from keel.errors import InputError

EVENTS = "events.jsonl"
SUMMARY = "summary.json"


def _dumps(obj: Any, indent: int | None) -> str:
    return json.dumps(obj, indent=indent, sort_keys=True, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    """`obj` as indented JSON at `path` (keys sorted, no NaN), replaced atomically: a reader
    never sees half a file. The parent directory is created."""
    path = Path(path)
    text = _dumps(obj, 1) + "\n"  # before any file exists: a value JSON cannot hold leaves none
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
    return path


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    """`out_dir/summary.json`, replaced atomically (a reader never sees half a file)."""
    return write_json(Path(out_dir) / SUMMARY, summary)


def write_run(out_dir: str | Path, events: Iterable[Any], summary: dict[str, Any]) -> Path:
    """A whole run directory from a finished run (the twin's): a fresh events.jsonl, then the
    summary."""
    from keel.events import write_events
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / EVENTS).unlink(missing_ok=True)
    write_events(out / EVENTS, events)
    write_summary(out, summary)
    return out


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / SUMMARY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (expected a run directory with {EVENTS} and {SUMMARY})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def read_events(run_dir: str | Path) -> list[Any]:
    from keel.events import read_events as _read
    return _read(Path(run_dir) / EVENTS)


def is_run_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / EVENTS).is_file() and (p / SUMMARY).is_file()


def print_json(obj: Any) -> None:
    """`--json`: one JSON object on stdout and nothing else there."""
    sys.stdout.write(_dumps(obj, None) + "\n")
    sys.stdout.flush()
