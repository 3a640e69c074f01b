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
