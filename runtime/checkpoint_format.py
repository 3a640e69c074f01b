"""The checkpoint format's names and limits (docs/checkpoint-format.md), shared by the writer
(runtime/checkpoint.py) and the loader (runtime/checkpoint_read.py)."""
from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from keel.errors import InputError

FORMAT = "keel-checkpoint"
FORMAT_VERSION = 1
FIELDS = ("weights", "optimizer_state", "rng_state", "data_offset", "config_hash", "cluster_topology", "commit_sha")
FIELD_FILES = {
    "weights": ["weights.safetensors"],
    "optimizer_state": ["optimizer_state.safetensors", "optimizer_state.json"],
    "rng_state": ["rng_state.safetensors", "rng_state.json"],
    "data_offset": ["context.json"],
    "config_hash": ["context.json"],
    "cluster_topology": ["context.json"],
    "commit_sha": ["context.json"],
}
FILES = tuple(dict.fromkeys(f for files in FIELD_FILES.values() for f in files))
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_DIR = re.compile(r"^\.(?:tmp|trash)-step-\d{8}-(\d+)-[0-9a-f]+$")  # a save in progress, or a removal
MAX_MANIFEST_BYTES = 2**20    # a manifest lists six files: anything larger is not one
REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header (the library refuses larger ones too)
HEX = re.compile(r"^[0-9a-f]+$")


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@functools.lru_cache(maxsize=1)
def current_commit_sha() -> str:
    """40 hex of the code's git HEAD, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if len(out) == 40 and HEX.match(out) else "unknown"
