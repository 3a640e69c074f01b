"""Where the project's files are: the repository root and the packaged example scenarios.

The example scenarios live in the repository's top-level `scenarios/` folder, which the
distribution installs as the package `keel.scenarios` (pyproject.toml maps one to the other),
so an installed `keel` finds them by name from any directory, as a checkout does.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _scenarios_dir() -> Path:
    """The folder of the packaged scenarios: `keel.scenarios` where it is importable (a wheel,
    an editable install), else the checkout's `scenarios/` (a bare source tree)."""
    from importlib import resources
    try:
        return Path(str(resources.files("keel.scenarios")))
    except ModuleNotFoundError:
        return REPO_ROOT / "scenarios"


SCENARIOS = _scenarios_dir()
DEFAULT_NAME = "multiregion-46"
DEFAULT_SCENARIO = SCENARIOS / f"{DEFAULT_NAME}.toml"
LOCAL_SCENARIO = SCENARIOS / "local-8.toml"


def scenario_names() -> list[str]:
    """The packaged scenarios' names (`multiregion-46`, ...), sorted."""
    return sorted(p.stem for p in SCENARIOS.glob("*.toml"))


def resolve_scenario(text: str) -> Path:
    """A scenario argument as a path: an existing file or folder as given, else a packaged
    scenario's name (`multiregion-46` or `multiregion-46.toml`), else the path as given (the
    loader then says there is no such file)."""
    path = Path(text)
    if path.exists() or path.parent != Path("."):
        return path
    packaged = SCENARIOS / (text if text.endswith(".toml") else f"{text}.toml")
    return packaged if packaged.is_file() else path
