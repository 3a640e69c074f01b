"""The event log: one schema for predicted (twin) and observed (runtime) runs.

An event: {"t": seconds since run start, "step": steps committed so far, "kind": str,
"fault": class or null, "target": str or null, "action": str or null, "detail": {}}.
Events that belong to one fault episode carry the same integer `detail["fault_id"]`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from keel.errors import InputError
from keel.recovery import ABSORB_ACTION, ENDURE_ACTION, FAIL_ACTION, RESTART_ACTION
from keel.scenario import FAULT_CLASSES

KINDS = (
    "run_start", "step", "fault", "detect", "recover_start", "recover_end", "reslot",
    "quarantine", "checkpoint_start", "checkpoint_end", "restart", "run_end",
)
ACTIONS = (*ABSORB_ACTION.values(), RESTART_ACTION, ENDURE_ACTION, FAIL_ACTION)


class EventLogError(InputError):
    """An events.jsonl that does not follow the schema; the message names file and line."""


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    step: int
    kind: str
    fault: str | None = None
    target: str | None = None
    action: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"t": self.t, "step": self.step, "kind": self.kind, "fault": self.fault,
                "target": self.target, "action": self.action, "detail": self.detail}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def fault_id(self) -> int | None:
        return self.detail.get("fault_id")


def validate_event(d: Any, where: str = "event") -> Event:
    if not isinstance(d, dict):
        raise EventLogError(f"{where}: expected a JSON object, got {type(d).__name__}")
    missing = {"t", "step", "kind"} - set(d)
    if missing:
        raise EventLogError(f"{where}: missing key(s) {', '.join(sorted(missing))}")
    extra = set(d) - {"t", "step", "kind", "fault", "target", "action", "detail"}
    if extra:
        raise EventLogError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
    if d["kind"] not in KINDS:
        raise EventLogError(f"{where}: key 'kind': expected one of {', '.join(KINDS)}, got {d['kind']!r}")
    if not isinstance(d["t"], (int, float)) or isinstance(d["t"], bool) or not 0 <= d["t"] < math.inf:
        raise EventLogError(f"{where}: key 't': expected seconds >= 0, got {d['t']!r}")
    if not isinstance(d["step"], int) or isinstance(d["step"], bool) or d["step"] < 0:
        raise EventLogError(f"{where}: key 'step': expected an integer >= 0, got {d['step']!r}")
    fault = d.get("fault")
    for key in ("fault", "action", "target"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise EventLogError(f"{where}: key '{key}': expected a string or null, got {json.dumps(d[key])[:60]}")
    if fault is not None and fault not in FAULT_CLASSES:
        raise EventLogError(f"{where}: key 'fault': expected one of {', '.join(FAULT_CLASSES)} or null, got {fault!r}")
    action = d.get("action")
    if action is not None and action not in ACTIONS:
        raise EventLogError(f"{where}: key 'action': expected one of {', '.join(ACTIONS)} or null, got {action!r}")
    detail = d.get("detail") or {}
    if not isinstance(detail, dict):
        raise EventLogError(f"{where}: key 'detail': expected an object, got {detail!r}")
    return Event(float(d["t"]), d["step"], d["kind"], fault, d.get("target"), action, detail)


class EventLog:
    """Appends events to `events.jsonl`, one line each, flushed as written (and fsynced on
    close), so a killed run leaves every event it wrote before the kill."""

    def __init__(self, path: str | Path, fsync_every: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync_every = fsync_every
        self.events: list[Event] = []

    def emit(self, event: Event) -> Event:
        self._f.write(event.to_json() + "\n")
        self._f.flush()
        if self._fsync_every:
            os.fsync(self._f.fileno())
        self.events.append(event)
        return event

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_events(path: str | Path, events: Iterable[Event]) -> None:
    with EventLog(path) as log:
        for e in events:
            log.emit(e)


def parse_line(raw: bytes, where: str) -> Event | None:
    """One line of events.jsonl as read from the file (`where`: "FILE:LINE"); None for a blank
    line. Damage is an EventLogError naming `where`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise EventLogError(f"{where}: not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise EventLogError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise EventLogError(f"{where}: nested too deeply to be an event") from None
    return validate_event(d, where)


def iter_events(path: str | Path) -> Iterator[Event]:
    path = Path(path)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            event = parse_line(raw, f"{path}:{n}")
            if event is not None:
                yield event


def read_events(path: str | Path) -> list[Event]:
    return list(iter_events(path))
