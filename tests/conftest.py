import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "scenarios"
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture
def repo() -> Path:
    return REPO


def keel_cmd(*args: str) -> list[str]:
    """Argv that runs the `keel` CLI of this checkout in a fresh interpreter."""
    return [sys.executable, "-m", "keel.cli", *args]


# ----------------------------------------------------------------------------- reliability (issue 13)
# Tests marked `reliability` run at REDUCED counts in `make test` and at FULL counts in
# `make reliability` (KEEL_RELIABILITY=full), which also tabulates what each test recorded
# through the `record` fixture into docs/reliability.md (bench/reliability.py).

import json as _json
import time as _time

RELIABILITY_FULL = os.environ.get("KEEL_RELIABILITY", "") == "full"
RELIABILITY_LOG = "KEEL_RELIABILITY_LOG"  # env var: the JSON-lines file records are appended to


def reliability_count(full: int, reduced: int) -> int:
    """How many trials a reliability test runs: `full` under KEEL_RELIABILITY=full, else `reduced`."""
    return full if RELIABILITY_FULL else reduced


def _append_record(line: dict) -> None:
    path = os.environ.get(RELIABILITY_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
            f.write(_json.dumps(line, sort_keys=True) + "\n")


class Record:
    """Counts of one reliability test. `record(trials=1, faults_survived=1)` adds to them;
    `record.note(key, value)` keeps a short fact for the report. Written once, at teardown,
    as one JSON line to $KEEL_RELIABILITY_LOG (nothing is written when it is unset)."""
    KEYS = ("trials", "faults_survived", "bad_inputs", "losses")

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.counts = dict.fromkeys(self.KEYS, 0)
        self.notes: dict[str, object] = {}

    def __call__(self, *, trials: int = 0, faults_survived: int = 0, bad_inputs: int = 0, losses: int = 0) -> None:
        for key, n in zip(self.KEYS, (trials, faults_survived, bad_inputs, losses)):
            self.counts[key] += int(n)

    def note(self, key: str, value: object) -> None:
        self.notes[key] = value


@pytest.fixture
def record(request):
    """A reliability test's counts (see Record); `make reliability` tabulates them."""
    r = Record(request.node.nodeid)
    yield r
    _append_record({"kind": "record", "test": r.nodeid, **r.counts, "notes": r.notes, "full": RELIABILITY_FULL})


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability: an issue-13 reliability test (full counts under "
                                       "KEEL_RELIABILITY=full; `make reliability` tabulates its `record`)")


def pytest_runtest_logreport(report):
    """Under `make reliability`, every reliability test's outcome (with its duration) goes to the log too."""
    if not os.environ.get(RELIABILITY_LOG) or "reliability" not in report.keywords:
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    _append_record({"kind": "outcome", "test": report.nodeid, "when": report.when, "outcome": outcome,
                    "duration_s": round(report.duration, 3), "t": _time.time()})
