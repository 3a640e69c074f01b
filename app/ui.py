"""What the pages share: session state (set with `setdefault`), the current scenario, the
runs directory, pickers, and calling the twin. UI glue only."""
from __future__ import annotations

import math

import os
from pathlib import Path
from typing import Any, Sequence

import streamlit as st

from app import data
from keel import rundir, scenario as sc
from keel.errors import InputError
from keel.paths import DEFAULT_SCENARIO, SCENARIOS

PAGES = {
    "runs": "pages/runs.py", "topology": "pages/topology.py", "simulate": "pages/simulate.py",
    "plan": "pages/plan.py", "compare": "pages/compare.py", "checkpoints": "pages/checkpoints.py",
}


PAGE_TITLES = {"runs": ("Runs", ":material/folder_open:"), "topology": ("Topology", ":material/hub:"),
               "simulate": ("Simulate", ":material/timeline:"), "plan": ("Plan", ":material/tune:"),
               "compare": ("Compare", ":material/compare_arrows:"), "checkpoints": ("Checkpoints", ":material/save:")}


def pages() -> list:
    return [st.Page(PAGES[k], title=t, icon=i, default=k == "runs") for k, (t, i) in PAGE_TITLES.items()]


def entry_guard() -> None:
    """At the top of every page. Streamlit runs a `pages/` script on its own (its older
    multipage mode) when a fresh server's first visitor opens a page's URL directly; then
    declare the navigation and rerun, so main.py runs and the page gets its setup."""
    if not st.session_state.get("_keel_entry"):
        st.navigation(pages(), position="hidden")
        st.rerun()


def init_state() -> None:
    s = st.session_state
    s["_keel_entry"] = True
    s.setdefault("runs_root", str(data.runs_root()))
    s.setdefault("scenario_path", str(DEFAULT_SCENARIO))
    s.setdefault("scenario_text", None)       # TOML text of the loaded scenario file
    s.setdefault("scenario_reshaped", None)   # the scenario with regions/links added or removed (Topology), plain
    s.setdefault("scenario_overrides", [])    # dotted key=value edits over it (Topology)
    s.setdefault("sim_results", {})          # label -> {"events", "summary", "overrides"}
    s.setdefault("policy_b", None)            # {dotted key: value}, sent from Plan
    s.setdefault("policy_b_label", None)


def runs_root() -> Path:
    return Path(st.session_state.get("runs_root") or data.runs_root())


def sidebar() -> None:
    with st.sidebar:
        st.text_input("runs directory", key="runs_root",
                      help="where `keel simulate/run/validate/plan --out` wrote their results (env KEEL_RUNS)")
        scn = current_scenario_or_none()
        if scn is not None:
            edits = len(st.session_state.get("scenario_overrides") or []) + bool(st.session_state.get("scenario_reshaped"))
            st.caption(f"scenario: **{scn.run.name}** ({Path(scn.source).name}"
                       + (f", {edits} edit{'s' * (edits != 1)}" if edits else "") + ")")


# ----------------------------------------------------------------------------- scenario

def scenario_files() -> list[Path]:
    """The example scenarios plus any under `KEEL_SCENARIOS` and the runs directory's top."""
    found: list[Path] = sorted(SCENARIOS.glob("*.toml"))
    extra = os.environ.get("KEEL_SCENARIOS")
    for folder in filter(None, [extra and Path(extra), runs_root() / "scenarios"]):
        if folder.is_dir():
            found += sorted(folder.glob("*.toml"))
    current = Path(st.session_state.get("scenario_path") or DEFAULT_SCENARIO)
    if current not in found and current.is_file():
        found.append(current)
    return found


def load_scenario_file(path: str | Path) -> None:
    """Make `path` the current scenario (edits dropped); raises ScenarioError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise sc.ScenarioError(f"{path}: cannot read the scenario file ({e.strerror})") from None
    sc.loads(text, str(path))  # check before adopting it
    st.session_state["scenario_path"] = str(path)
    st.session_state["scenario_text"] = text
    st.session_state["scenario_reshaped"] = None
    st.session_state["scenario_overrides"] = []


def file_scenario() -> sc.Scenario:
    """The loaded scenario file as it is on disk."""
    s = st.session_state
    if s.get("scenario_text") is None:
        load_scenario_file(s.get("scenario_path") or DEFAULT_SCENARIO)
    return sc.loads(s["scenario_text"], s["scenario_path"])


def base_scenario(overrides: Sequence[str] = ()) -> sc.Scenario:
    """The loaded file with the Topology page's added or removed regions and links (the
    base its dotted-key edits apply to), plus `overrides`."""
    s = st.session_state
    if s.get("scenario_reshaped") is not None:
        return sc.from_dict(s["scenario_reshaped"], s["scenario_path"], overrides)
    file_scenario()  # reads the file into the session on first use
    return sc.loads(s["scenario_text"], s["scenario_path"], overrides)


def reshape(plain: dict[str, Any]) -> None:
    """Make `plain` (a resolved scenario with regions or links added or removed) the base
    of the current scenario; raises ScenarioError where the schema refuses it."""
    sc.from_dict(plain, st.session_state["scenario_path"])
    st.session_state["scenario_reshaped"] = plain
    st.session_state["scenario_overrides"] = []


def current_scenario(overrides: Sequence[str] | None = None) -> sc.Scenario:
    """The scenario the pages work on: the loaded file with the Topology edits, plus
    `overrides` on top. Raises ScenarioError for edits the schema refuses."""
    edits = list(st.session_state.get("scenario_overrides") or []) + list(overrides or [])
    return base_scenario(edits)


def current_scenario_or_none() -> sc.Scenario | None:
    try:
        return current_scenario()
    except InputError:
        return None


def scenario_file_for(scenario: sc.Scenario, folder: Path) -> Path:
    """The resolved scenario written as TOML (for CLIs that take a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.toml"
    path.write_text(sc.dumps(scenario))
    return path


# ----------------------------------------------------------------------------- the twin

def twin_available() -> bool:
    try:
        import twin  # noqa: F401
        return hasattr(twin, "simulate")
    except ImportError:
        return False


def simulate(scenario: sc.Scenario, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    import twin
    result = twin.simulate(scenario, seed=seed)
    return list(result.events), dict(result.summary)


def twin_headline(scenario: sc.Scenario) -> dict[str, Any]:
    """The twin's summary of a scenario on its own seed, cached by the scenario's content."""
    return _twin_summary_cached(sc.dumps(scenario), scenario.source)


@st.cache_data(max_entries=16, show_spinner=False)
def _twin_summary_cached(text: str, source: str) -> dict[str, Any]:
    _, summary = simulate(sc.loads(text, source))
    return summary


def save_run(events: Sequence[Any], summary: dict[str, Any], out: Path) -> Path:
    """A twin result in `keel simulate --out`'s layout (events.jsonl, summary.json)."""
    return rundir.write_run(out, events, summary)


# ----------------------------------------------------------------------------- pickers

def pick_dir(label: str, kinds: Sequence[str], key: str) -> Path | None:
    """A select box over the matching directories under the runs directory, and a path
    field that wins when filled in. None when there is nothing to pick."""
    runs = data.jobs_first(data.list_runs(runs_root(), kinds))  # the newest job first, never a validation's part
    labels = {str(r.path): f"{r.label}  ({r.kind}" + (f", part of {r.parent.relative_to(runs_root())})"
                                                      if r.parent is not None and r.parent.is_relative_to(runs_root())
                                                      else ")") for r in runs}
    choice = None
    if runs:
        choice = st.selectbox(label, list(labels), key=key, format_func=lambda p: labels.get(p, p))
    typed = st.text_input("or a directory path" if runs else f"{label}: a directory path", key=f"{key}:typed",
                          help=f"a {' or '.join(kinds)} directory anywhere on this machine")
    if typed.strip():
        return Path(typed.strip()).expanduser()
    return Path(choice) if choice else None


def seconds(x: float | None) -> str:
    """A duration for a metric tile: 0.182 s, 12.5 s, 6.43 h."""
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return f"{x} s"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 100:
        return f"{x:,.0f} s"
    return f"{x:.3g} s"


def show_error(e: Exception) -> None:
    st.error(str(e), icon=":material/error:")
