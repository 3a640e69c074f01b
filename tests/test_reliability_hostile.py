"""Issue 28: a long run's event log (200 MB under `make reliability`, 4 MB in `make test`)
opened as the dashboard opens it and rendered by `keel report`: read once, line by line,
summarised; memory and the report's size stay bounded whatever the log's length. Times and
sizes go to docs/reliability.md (bench/reliability.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import reliability_count
from runtime_helpers import REPO

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]
LOG_MB = reliability_count(full=200, reduced=4)

_OPEN = """
import json, sys, time
from app import loaders
t = time.perf_counter()
events, summary = loaders.load_run(sys.argv[1])
# this process's own peak (VmHWM: getrusage's ru_maxrss keeps the forking parent's across exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"open_s": time.perf_counter() - t, "kept": len(events), "lines": events.lines,
                  "faults": len(summary["faults"]), "peak_rss_mb": hwm / 1024}))
"""


def _write_log(run, mb: int) -> int:
    """A run of steps at 50 ms with a hardware fault every 100,000 steps; lines written."""
    from keel import metrics
    from keel.events import Event
    run.mkdir()
    step = '{"action":null,"detail":{"gen":1,"loss":%.7f,"members":44},"fault":null,"kind":"step","step":%d,"t":%.3f,"target":null}\n'
    fault = ('{"action":"replicate_resume","detail":{"fault_id":%d},"fault":"hardware_fault","kind":"fault",'
             '"step":%d,"t":%.3f,"target":"a/1"}\n')
    lines, size, i = 0, 0, 0
    with open(run / "events.jsonl", "w") as f:
        f.write(Event(0.0, 0, "run_start").to_json() + "\n")
        while size < mb * 1_000_000:
            i += 1
            chunk = step % (2.5 - i * 1e-7, i, i * 0.05)
            if i % 100_000 == 0:
                chunk += fault % (i // 100_000, i, i * 0.05 + 0.01)
                lines += 1
            f.write(chunk)
            size += len(chunk)
            lines += 1
        f.write(Event(i * 0.05 + 0.05, i, "run_end").to_json() + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": i, "wall_s": i * 0.05, "step_time_s": 0.05, "goodput": 1.0,
                                                 "restarts": 0, "faults": []}))
    assert metrics  # the summary is hand-written: the figures do not matter here, the log's size does
    return lines + 2


def test_a_long_event_log_opens_bounded_and_reports_bounded(tmp_path, record):
    run = tmp_path / "long"
    lines = _write_log(run, LOG_MB)
    size_mb = (run / "events.jsonl").stat().st_size / 1e6
    p = subprocess.run([sys.executable, "-c", _OPEN, str(run)], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert p.returncode == 0, p.stderr
    opened = json.loads(p.stdout)
    assert opened["lines"] == lines and opened["kept"] < 5000  # every line read, a summary kept
    assert opened["peak_rss_mb"] < 400, opened  # bounded: python, streamlit's imports and the summary
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "keel.cli", "report", str(run)], capture_output=True, text=True,
                       cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stderr
    report_s = time.perf_counter() - t0
    report_mb = (run / "report.html").stat().st_size / 1e6
    assert report_mb < 10  # the charts carry the summary, not the log
    record(trials=1)
    record.note("long log", f"{size_mb:.0f} MB, {lines:,} lines: opened in {opened['open_s']:.1f} s, peak RSS "
                            f"{opened['peak_rss_mb']:.0f} MB; keel report {report_mb:.1f} MB in {report_s:.1f} s (its whole process)")


# ----------------------------------------------------------------------------- every value replaced

def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        yield from _leaves(obj[0], (*path, 0))
    if path:
        yield path


def _replaced(obj, path, value):
    out = json.loads(json.dumps(obj))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


VALUES = reliability_count(full=("x", [], {}, None, -1, 1e308, True, [None]), reduced=("x", None))


@pytest.mark.parametrize("name", ["comparison.json", "plan.json", "summary.json"])
def test_any_value_of_the_wrong_type_is_damage_never_a_crash(tmp_path, name, record, monkeypatch):
    """Each value the file holds (the first item of each list), replaced in turn by values of
    other types: the report's sections are built or the file is refused as damaged; no other
    exception escapes."""
    from app import data, loaders, report
    from test_app_hostile import _run
    from test_app_runs import handwritten_plan, handwritten_validation
    if name == "plan.json":
        target, build = handwritten_plan(tmp_path), report.plan_sections
    elif name == "comparison.json":
        target, build = handwritten_validation(tmp_path), report.validation_sections
        monkeypatch.setattr(data, "validation_runs", lambda path: {})  # its runs: test_app_hostile.py
    else:
        target, build = _run(tmp_path / "run"), report.run_sections
    original = json.loads((target / name).read_text())
    tried = refused = 0
    for path in _leaves(original):
        for value in VALUES:
            (target / name).write_text(json.dumps(_replaced(original, path, value)))
            tried += 1
            try:
                build(target)
            except loaders.InputError as e:
                refused += 1
                assert str(target / name) in str(e) and "\n" not in str(e)
    assert tried > 20 and 0 < refused < tried
    record(trials=tried, bad_inputs=refused)
    record.note(name, f"{tried} files, each with one value replaced ({', '.join(map(json.dumps, VALUES))}): "
                      f"{refused} refused as damaged naming the file and key, {tried - refused} shown")
