"""Where the project's files are: the repository root and the bundled scenarios."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = REPO_ROOT / "scenarios"
DEFAULT_SCENARIO = SCENARIOS / "multiregion-46.toml"
LOCAL_SCENARIO = SCENARIOS / "local-8.toml"
