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
import json, resource, sys, time
from app import loaders
t = time.perf_counter()
events, summary = loaders.load_run(sys.argv[1])
print(json.dumps({"open_s": time.perf_counter() - t, "kept": len(events), "lines": events.lines,
                  "faults": len(summary["faults"]), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
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
