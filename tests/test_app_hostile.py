"""Issue 28: every file of a run directory is untrusted input. A damaged run (events not
UTF-8, a summary with wrong types, `faults` as a list of strings, NaN or Infinity) is shown
on every dashboard page as damaged, with file, line or key, and reason; `keel report` says
the same in one line, exit 2; runs are found without following symbolic links; a long log
is read once, summarised (steps thinned, every other event kept)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app import data, loaders
from keel import metrics
from keel.cli import main as keel_main
from keel.events import Event, write_events
from test_app_runs import REPO

MAIN = REPO / "app" / "main.py"
pytestmark = pytest.mark.timeout(240)


def _events(steps: int = 6) -> list[Event]:
    ev = [Event(0.0, 0, "run_start")]
    ev += [Event(0.1 * i, i, "step", detail={"loss": 2.0}) for i in range(1, steps)]
    ev += [Event(0.1 * steps - 0.05, steps - 1, "fault", "hardware_fault", "a/1", "replicate_resume", {"fault_id": 0}),
           Event(0.1 * steps, steps, "step"), Event(0.1 * steps + 0.01, steps, "run_end")]
    return ev


def _run(path: Path, steps: int = 6) -> Path:
    path.mkdir(parents=True)
    ev = _events(steps)
    write_events(path / "events.jsonl", ev)
    (path / "summary.json").write_text(json.dumps(metrics.summarize(ev)))
    return path


def _damage(path: Path, how: str) -> tuple[Path, str]:
    """Damage the run at `path`; (the file, what its message must say)."""
    ev, summary = path / "events.jsonl", path / "summary.json"
    if how == "not-utf8":
        lines = ev.read_bytes().splitlines(keepends=True)
        ev.write_bytes(b"".join(lines[:2] + [b'{"t": 0.3, "kind": "st\xff\xfeep"}\n'] + lines[2:]))
        return ev, "events.jsonl:3: not UTF-8 text"
    if how == "infinite-t":
        with open(ev, "a") as f:
            f.write('{"t": Infinity, "step": 9, "kind": "step"}\n')
        return ev, f"events.jsonl:{len(_events()) + 1}: key 't'"
    s = json.loads(summary.read_text())
    if how == "wrong-types":
        s["goodput"], s["restarts"] = "fast", [1]
        summary.write_text(json.dumps(s))
        return summary, "key 'goodput': expected a number"
    if how == "faults-strings":
        s["faults"] = ["hardware_fault", "network_jitter"]
        summary.write_text(json.dumps(s))
        return summary, "key 'faults.0': expected an object"
    if how == "nan":
        s["wall_s"] = float("nan")
        summary.write_text(json.dumps(s, indent=1))  # json writes NaN; keel never does
        return summary, "NaN is not a JSON number"
    raise AssertionError(how)


HOW = ("not-utf8", "infinite-t", "wrong-types", "faults-strings", "nan")


@pytest.fixture
def hostile_root(tmp_path) -> Path:
    """A runs root of damaged runs, a validation whose repetition is damaged, a symbolic
    link loop and a link out of the root."""
    root = tmp_path / "runs"
    for how in HOW:
        _damage(_run(root / how), how)
    val = root / "validate"
    _run(val / "twin")
    _damage(_run(val / "runtime" / "rep-0"), "faults-strings")
    (val / "comparison.json").write_text(json.dumps({"faults": [], "tolerances": {"downtime_rel_tol": 0.05}}))
    (root / "plan").mkdir()
    (root / "plan" / "plan.json").write_text('{"trials": [], "improvement": {"cost_ratio": NaN}}')
    (root / "loop").symlink_to(root)
    _run(tmp_path / "outside" / "secret")
    (root / "out").symlink_to(tmp_path / "outside")
    return root


def test_runs_are_found_without_following_links(hostile_root):
    found = data.list_runs(hostile_root)
    assert sorted(r.label for r in found if r.is_job) == sorted([*HOW, "validate", "plan"])
    assert all("loop" not in r.label and "out" != r.label.split("/")[0] for r in found)


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_run_is_one_line_from_the_loader_and_from_keel_report(hostile_root, how, capsys):
    with pytest.raises(loaders.InputError) as e:
        loaders.load_run(hostile_root / how)
    assert str(hostile_root / how) in str(e.value) and "\n" not in str(e.value)
    assert keel_main(["report", str(hostile_root / how)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"keel: {e.value}"
    assert not (hostile_root / how / "report.html").exists()


def test_each_damage_is_named(tmp_path):
    for how in HOW:
        file, said = _damage(_run(tmp_path / how), how)
        with pytest.raises(loaders.InputError, match=str(file).replace(".", r"\.") + r".*") as e:
            loaders.load_run(tmp_path / how)
        assert said in str(e.value), (how, str(e.value))


def test_report_of_a_validation_with_a_damaged_repetition_is_exit_2(hostile_root, capsys):
    assert keel_main(["report", str(hostile_root / "validate")]) == 2
    assert "rep-0/summary.json: key 'faults.0'" in capsys.readouterr().err


def test_non_finite_numbers_are_shown_as_such():
    assert [data.fmt(x, ".3f") for x in (float("nan"), float("inf"), -float("inf"), None)] == \
        ["NaN", "inf", "-inf", data.MISSING]


def test_a_long_log_is_summarised_with_every_event_but_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "MAX_STEP_POINTS", 50)
    run = _run(tmp_path / "long", steps=5000)
    events, summary = loaders.load_run(run)
    full = list(_events(5000))
    assert events.lines == len(full) and events.steps == sum(e.kind == "step" for e in full)
    assert len(events) < 200
    assert [e for e in events if e.kind != "step"] == [e for e in full if e.kind != "step"]
    fault = next(i for i, e in enumerate(events) if e.kind == "fault")
    assert events[fault - 1] == full[-4] and events[fault + 1] == full[-2]  # the steps around the fault kept
    assert metrics.summarize(events)["faults"] == summary["faults"]


# ----------------------------------------------------------------------------- every page

@pytest.fixture(autouse=True)
def _fresh_caches():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _page(monkeypatch, root: Path, page: str | None) -> AppTest:
    monkeypatch.setenv("KEEL_RUNS", str(root))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    if page:
        at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _errors(at: AppTest) -> str:
    return "\n".join(e.value for e in at.error)


def test_every_page_over_a_hostile_runs_root(monkeypatch, hostile_root):
    at = _page(monkeypatch, hostile_root, None)  # Runs: the newest run is a damaged one
    assert str(hostile_root) in _errors(at)
    at = _page(monkeypatch, hostile_root, "simulate")
    at.radio(key="simulate_source").set_value("open a run directory").run()
    for how in HOW:
        at.text_input(key="simulate_dir:typed").input(str(hostile_root / how)).run()
        assert not at.exception, [e.value for e in at.exception]
        assert str(hostile_root / how) in _errors(at), how
    at = _page(monkeypatch, hostile_root, "compare")
    assert "rep-0/summary.json: key 'faults.0'" in _errors(at)
    at = _page(monkeypatch, hostile_root, "plan")
    at.text_input(key="plan_dir:typed").input(str(hostile_root / "plan")).run()
    assert not at.exception and "NaN is not a JSON number" in _errors(at)
    for page in ("checkpoints", "topology"):
        _page(monkeypatch, hostile_root, page)
