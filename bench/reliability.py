"""`make reliability`: every issue-13 reliability test at FULL counts, tabulated in docs/reliability.md.

    python bench/reliability.py [--reduced] [--out docs/reliability.md] [PYTEST_ARGS...]

PYTEST_ARGS may name test files (then only those run) or select with -k.

Runs `pytest -m reliability` over tests/ with KEEL_RELIABILITY=full (or the reduced counts of
`make test` with --reduced) and KEEL_RELIABILITY_LOG naming a JSON-lines file. Each test marked
`reliability` joins the table; the counts come from its `record` fixture (tests/conftest.py):

    @pytest.mark.reliability
    def test_something(record):
        for trial in range(reliability_count(full=100, reduced=5)):
            ...
            record(trials=1, faults_survived=1)      # or bad_inputs=1, losses=1

A test without `record` still gets a row (its outcome), with empty counts. The exit code is
pytest's; the table is written either way, with each test's outcome, so a failure is on record.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("trials", "faults_survived", "bad_inputs", "losses")


def _test_name(nodeid: str) -> str:
    """`tests/test_x.py::test_y[param]` -> `test_x.py::test_y` (parametrized cases are summed)."""
    return re.sub(r"\[.*\]$", "", nodeid).removeprefix("tests/")


def collect(lines: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = defaultdict(lambda: {**dict.fromkeys(KEYS, 0), "cases": 0, "outcomes": defaultdict(int),
                                                 "duration_s": 0.0, "notes": {}, "recorded": False})
    for line in lines:
        row = rows[_test_name(line["test"])]
        if line.get("kind") == "record":
            row["recorded"] = True
            for k in KEYS:
                row[k] += int(line.get(k, 0))
            row["notes"].update(line.get("notes") or {})
        elif line.get("kind") == "outcome":  # one line per phase (setup, call, teardown) of each case
            row["duration_s"] += float(line.get("duration_s", 0.0))
            if line.get("when") == "call" or line["outcome"] != "passed":
                row["outcomes"][line["outcome"]] += 1
                row["cases"] += 1
    return dict(sorted(rows.items()))


def _outcome(row: dict) -> str:
    o = row["outcomes"]
    if not o:
        return "no outcome"
    parts = [f"{n} {k}" for k, n in sorted(o.items())]
    return ", ".join(parts)


def render(rows: dict[str, dict], *, command: str, wall_s: float, full: bool, rc: int, when: str) -> str:
    total = {k: sum(r[k] for r in rows.values()) for k in KEYS}
    failed = [name for name, r in rows.items() if any(k not in ("passed", "skipped", "xfailed") for k in r["outcomes"])]
    out = [
        "# Reliability (issue 13)",
        "",
        f"Measured {when} with `{command}` ({'FULL' if full else 'REDUCED'} counts), "
        f"{wall_s / 60:.1f} min wall on {os.cpu_count()} cores ({platform.machine()}, Python {platform.python_version()}); "
        f"pytest exit code {rc}.",
        "",
        "Each row is a test marked `reliability`; its counts are what it recorded through the `record` fixture "
        "(tests/conftest.py). *Trials*: independent attempts (a kill, a damaged checkpoint, a hostile input); "
        "*faults survived*: injected faults after which the run (or the reader) ended in the state the test "
        "demands; *bad inputs tried*: damaged, torn or hostile inputs presented to a reader or the CLI "
        "(every one refused, or the test fails); *losses*: committed work lost or a bad input accepted.",
        "",
        "| test | cases | trials | faults survived | bad inputs tried | losses | outcome | s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in rows.items():
        counts = [str(r[k]) if r["recorded"] else "-" for k in KEYS]
        if name in failed:  # what a failed test did not get to record is unknown
            counts[-1] = f"{counts[-1]} (test failed)"
        out.append(f"| `{name}` | {r['cases']} | {' | '.join(counts)} | {_outcome(r)} | {r['duration_s']:.0f} |")
    out.append(f"| **total** | {sum(r['cases'] for r in rows.values())} | "
               + " | ".join(f"**{total[k]}**" for k in KEYS) + f" | {'all passed' if not failed and rc == 0 else 'FAILURES'} | "
               f"{sum(r['duration_s'] for r in rows.values()):.0f} |")
    notes = [(name, r["notes"]) for name, r in rows.items() if r["notes"]]
    if notes:
        out += ["", "## Notes recorded by the tests", ""]
        for name, n in notes:
            facts = "; ".join(f"{k}: {v}" for k, v in n.items())
            out.append(f"- `{name}`: {facts}")
    if failed:
        out += ["", "## Failed", ""] + [f"- `{name}`" for name in failed]
    out += ["", "Add a test to this table: mark it `@pytest.mark.reliability`, size it with "
            "`conftest.reliability_count(full=..., reduced=...)` and record its counts with the `record` fixture; "
            "see bench/reliability.py.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="the reduced counts of make test (a quick look)")
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"), help="the report to write")
    args, pytest_args = ap.parse_known_args(argv)
    full = not args.reduced
    with tempfile.TemporaryDirectory(prefix="keel-reliability-") as tmp:
        log = Path(tmp) / "records.jsonl"
        env = {**os.environ, "KEEL_RELIABILITY_LOG": str(log)}
        env["KEEL_RELIABILITY"] = "full" if full else "reduced"
        paths = [] if any(not a.startswith("-") for a in pytest_args) else ["tests"]  # given paths: only those
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "reliability", "-p", "no:cacheprovider", *paths, *pytest_args]
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        wall = time.monotonic() - t0
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    rows = collect(lines)
    command = "make reliability" if full and not pytest_args else \
        "python bench/reliability.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    text = render(rows, command=command, wall_s=wall, full=full, rc=rc,
                  when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(args.out).write_text(text)
    total = {k: sum(r[k] for r in rows.values()) for k in KEYS}
    print(f"reliability: {len(rows)} tests, {total['trials']} trials, {total['faults_survived']} faults survived, "
          f"{total['bad_inputs']} bad inputs tried, {total['losses']} losses; {wall / 60:.1f} min; "
          f"pytest exit {rc}; wrote {args.out}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
