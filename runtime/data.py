"""The versioned dataset and the deterministic loader.

The corpus needs no download: it is the Python standard library's own source (the `*.py`
files under `sysconfig.get_paths()["stdlib"]`, site-packages excluded, in sorted relative-path
order, each preceded by a `# file: <path>` line), capped at `CORPUS_CAP_BYTES`, read as bytes
(byte-level tokens) and cut into `shards` shards of equal size. Each shard is content-hashed
(sha256); `index.json` records the shards, their hashes, sizes and sample counts; the dataset
version is the sha256 of the canonical JSON of the index. The same machine content gives the
same version.

A sample of context T is T+1 consecutive bytes starting at a multiple of T inside one shard
(x = the first T, y = the last T, the next-byte targets); a shard of n bytes holds (n-1)//T.

The loader is stateless: the samples of (step, slot) are a pure function of (dataset version,
seed, step, slot, quarantine set). Sample i of (step, slot) draws a global sample index from
blake2b-64("version|seed|step|slot|i|attempt") for attempt 0, 1, ... and takes the first draw
that lands outside the quarantined shards, so quarantining a shard replaces exactly its samples
and leaves every other sample where it was. Jumping to any step is O(1).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import shutil
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from keel.durable import fsync_dir, write_synced
from keel.errors import InputError
from keel.scenario_base import canonical_json

FORMAT = "keel-dataset"
FORMAT_VERSION = 1
CORPUS_CAP_BYTES = 4 * 2**20  # 4 MiB: building takes well under a second
SAMPLES_CONTEXT = 64  # the context the index's per-shard `samples` counts are given for
SAMPLER = "blake2b64-aligned-windows/1"
LOADER_FORMAT = "keel-loader"
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
REPO_ROOT = Path(__file__).resolve().parents[1]


def default_root(shards: int = 16) -> Path:
    """Where `ensure_dataset` keeps a dataset of `shards` shards: `$KEEL_DATA_DIR`, else the
    checkout's `data/` (beside pyproject.toml), else, for an installed copy, the user's cache
    (`$XDG_CACHE_HOME/keel/data`, ~/.cache/keel/data), never inside site-packages; then
    `stdlib-<shards>`."""
    if os.environ.get("KEEL_DATA_DIR"):
        base = Path(os.environ["KEEL_DATA_DIR"])
    elif (REPO_ROOT / "pyproject.toml").exists():
        base = REPO_ROOT / "data"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "keel" / "data"
    return base / f"stdlib-{shards}"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


# ----------------------------------------------------------------------------- the dataset

@dataclass(eq=False)
class Dataset:
    root: Path
    index: dict[str, Any]
    version: str
    data: np.ndarray = field(repr=False)  # uint8 [shards, shard_bytes]
    built: bool = False  # True when this call built it

    @property
    def shards(self) -> int:
        return self.data.shape[0]

    @property
    def shard_bytes(self) -> int:
        return self.data.shape[1]

    def samples_per_shard(self, context: int) -> int:
        return (self.shard_bytes - 1) // context

    @classmethod
    def open(cls, root: str | Path) -> Dataset:
        """Open and verify a dataset: every shard's sha256 is checked against the index;
        a shard whose bytes do not match is refused with an InputError naming its file."""
        root = Path(root)
        index_path = root / "index.json"
        try:
            index = json.loads(index_path.read_text())
        except FileNotFoundError:
            raise InputError(f"{index_path}: no dataset here (index.json missing); run `keel data prepare --out {root}`") from None
        except (OSError, ValueError) as e:
            raise InputError(f"{index_path}: unreadable dataset index ({e})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
            raise InputError(f"{index_path}: expected a {FORMAT} index of format version {FORMAT_VERSION}")
        shard_bytes = index.get("shard_bytes")
        entries = index.get("shards")
        if not (isinstance(shard_bytes, int) and shard_bytes > 0 and isinstance(entries, list) and entries
                and all(isinstance(e, dict) and isinstance(e.get("file"), str) and "/" not in e["file"]
                        and isinstance(e.get("sha256"), str) for e in entries)):
            raise InputError(f"{index_path}: malformed dataset index (shard_bytes, shards[].file, shards[].sha256)")
        data = np.empty((len(index["shards"]), shard_bytes), dtype=np.uint8)
        for i, entry in enumerate(index["shards"]):
            path = root / entry["file"]
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                raise InputError(f"{path}: shard {i} is missing from the dataset") from None
            digest = hashlib.sha256(raw).hexdigest()
            if len(raw) != shard_bytes or digest != entry["sha256"]:
                raise InputError(
                    f"{path}: shard {i} does not match the dataset index (sha256 {digest[:16]}..., "
                    f"{len(raw)} bytes; expected {entry['sha256'][:16]}..., {shard_bytes} bytes); "
                    f"the dataset was altered: delete {root} and run `keel data prepare`")
            data[i] = np.frombuffer(raw, dtype=np.uint8)
        version = hashlib.sha256(canonical_json(index).encode()).hexdigest()
        return cls(root=root, index=index, version=version, data=data)


def _corpus_files(stdlib: Path) -> list[tuple[str, Path]]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath, name)
                files.append((p.relative_to(stdlib).as_posix(), p))
    return sorted(files)


def build_corpus(cap: int = CORPUS_CAP_BYTES, progress: bool = False) -> tuple[bytes, dict[str, Any]]:
    """The corpus bytes (at most `cap`) and a description of where they came from."""
    from keel.progress import progress_bar

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    used = total = 0
    first = last = None
    with progress_bar(total=cap, unit="B", desc="corpus", enabled=progress) as bar:
        for rel, path in _corpus_files(stdlib):
            chunk = f"# file: {rel}\n".encode() + path.read_bytes() + b"\n"
            chunk = chunk[: cap - total]
            parts.append(chunk)
            total += len(chunk)
            used += 1
            first = first or rel
            last = rel
            bar.update(len(chunk))
            if total >= cap:
                break
    source = {"kind": "python-stdlib", "python": platform.python_version(), "files": used,
              "first_file": first, "last_file": last, "bytes": total}
    return b"".join(parts), source




def build_dataset(root: Path, shards: int, progress: bool = False) -> None:
    """Build into a temporary directory next to `root`, then rename it into place. If another
    process got there first, its dataset stands and ours is discarded."""
    if shards < 1:
        raise InputError(f"data.shards: expected a positive number of shards, got {shards}")
    from keel.progress import progress_bar

    corpus, source = build_corpus(progress=progress)
    shard_bytes = len(corpus) // shards
    if shard_bytes < 2 * SAMPLES_CONTEXT:
        raise InputError(f"data.shards: {shards} shards of a {len(corpus)}-byte corpus are too small; use fewer shards")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        entries = []
        with progress_bar(total=shards, desc="shards", unit="shard", enabled=progress) as bar:
            for i in range(shards):
                raw = corpus[i * shard_bytes:(i + 1) * shard_bytes]
                write_synced(tmp / shard_name(i), raw)
                entries.append({"index": i, "file": shard_name(i), "sha256": hashlib.sha256(raw).hexdigest(),
                                "bytes": len(raw), "samples": (len(raw) - 1) // SAMPLES_CONTEXT})
                bar.update(1)
        index = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source,
                 "shard_bytes": shard_bytes, "samples_context": SAMPLES_CONTEXT,
                 "sample": "context+1 consecutive bytes at a multiple of context in one shard; (bytes-1)//context per shard",
                 "shards": entries}
        write_synced(tmp / "index.json", (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
        fsync_dir(tmp)
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / "index.json").exists():
                raise
            return  # a concurrent builder won; ours goes
        fsync_dir(root.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_dataset(root: str | Path | None = None, shards: int = 16, progress: bool = False) -> Dataset:
    """The dataset at `root` (default: `default_root(shards)`), built first if missing, verified
    either way. Safe to call from several processes at once."""
    root = Path(root) if root is not None else default_root(shards)
    built = False
    if not (root / "index.json").exists():
        build_dataset(root, shards, progress=progress)
        built = True
    ds = Dataset.open(root)
    if ds.shards != shards:
        raise InputError(f"{root}: the dataset there has {ds.shards} shards, expected {shards} (data.shards); "
                         f"use another directory or delete it")
    ds.built = built
    return ds


# ----------------------------------------------------------------------------- the loader

@dataclass(frozen=True)
class Batch:
    x: torch.Tensor  # LongTensor[B, T]
    y: torch.Tensor  # LongTensor[B, T], next-byte targets
    w: torch.Tensor  # float32[B]: 1.0, or NaN for a sample from a poisoned shard
    shards: tuple[int, ...]  # the shard of each sample


class Sampler:
    """keel's one sampler, for every job: the global sample indices of (step, slot) as a pure
    function of (dataset version, seed, step, slot, quarantine set) over `shards` shards of
    `per_shard` samples each (sample g lies in shard g // per_shard)."""

    def __init__(self, version: str, seed: int, per_shard: int, shards: int, micro_batch: int) -> None:
        self.per_shard, self.shards, self.micro_batch = per_shard, shards, micro_batch
        self.total = per_shard * shards
        self._prefix = hashlib.blake2b(f"{version}|{int(seed)}|".encode(), digest_size=8)

    def indices(self, step: int, slot: int, quarantine: Iterable[int] = frozenset()) -> list[int]:
        quarantine = frozenset(quarantine)
        if len(quarantine & set(range(self.shards))) >= self.shards:
            raise InputError("every shard of the dataset is quarantined; no sample is left to draw")
        out = []
        for i in range(self.micro_batch):
            attempt = 0
            while True:
                h = self._prefix.copy()
                h.update(f"{step}|{slot}|{i}|{attempt}".encode())
                g = int.from_bytes(h.digest(), "little") % self.total
                if g // self.per_shard not in quarantine:
                    break
                attempt += 1
            out.append(g)
        return out


class Loader:
    """Samples of (step, slot) as a pure function of (dataset version, seed, step, slot,
    quarantine set); no state advances, so any step is reached in O(1)."""

    def __init__(self, dataset: Dataset, seed: int, context: int, micro_batch: int) -> None:
        if context < 1 or micro_batch < 1:
            raise InputError(f"expected a positive context and micro_batch, got {context} and {micro_batch}")
        self.per_shard = dataset.samples_per_shard(context)
        if self.per_shard < 1:
            raise InputError(f"model.context {context} is longer than a shard ({dataset.shard_bytes} bytes); use fewer data.shards")
        self.dataset = dataset
        self.seed = int(seed)
        self.context = context
        self.micro_batch = micro_batch
        self.sampler = Sampler(dataset.version, self.seed, self.per_shard, dataset.shards, micro_batch)
        self.total = self.sampler.total
        self._offsets = np.arange(context + 1)

    def sample_indices(self, step: int, slot: int, quarantine: Iterable[int] = frozenset()) -> list[int]:
        """Global sample indices (shard * per_shard + window) of (step, slot)."""
        return self.sampler.indices(step, slot, quarantine)

    def sample(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `g` as (x, y): LongTensor[context] each, y the next-byte targets of x."""
        shard, window = divmod(int(g), self.per_shard)
        row = torch.from_numpy(self.dataset.data[shard, window * self.context + self._offsets].astype(np.int64))
        return row[:-1], row[1:]

    def batch(self, step: int, slot: int, quarantine: frozenset[int] = frozenset(),
              poisoned: frozenset[int] = frozenset()) -> Batch:
        """The micro-batch of `slot` at `step` (0-based index of the step being computed)."""
        g = np.array(self.sample_indices(step, slot, quarantine), dtype=np.int64)
        shard, window = np.divmod(g, self.per_shard)
        rows = self.dataset.data[shard[:, None], window[:, None] * self.context + self._offsets]
        xy = torch.from_numpy(rows.astype(np.int64))
        shards = tuple(int(s) for s in shard)
        w = torch.tensor([float("nan") if s in poisoned else 1.0 for s in shards], dtype=torch.float32)
        return Batch(x=xy[:, :-1].contiguous(), y=xy[:, 1:].contiguous(), w=w, shards=shards)

    def state(self, step: int, quarantine: Iterable[int] = frozenset()) -> dict[str, Any]:
        """What a checkpoint records to resume the data stream: `step` is the 0-based index of
        the next step to compute (the number of steps committed)."""
        return {"format": LOADER_FORMAT, "sampler": SAMPLER, "version": self.dataset.version,
                "seed": self.seed, "step": int(step), "quarantine": sorted(int(q) for q in quarantine),
                "context": self.context, "micro_batch": self.micro_batch, "shards": self.dataset.shards}

    @classmethod
    def from_state(cls, dataset: Dataset, state: dict[str, Any], context: int, micro_batch: int) -> Loader:
        """A loader that continues the stream a `state()` describes; refuses a different
        dataset version or sampler."""
        if state.get("format") != LOADER_FORMAT or state.get("sampler") != SAMPLER:
            raise InputError(f"data offset: expected a {LOADER_FORMAT} state with sampler {SAMPLER}, "
                             f"got {state.get('format')!r} / {state.get('sampler')!r}")
        if state["version"] != dataset.version:
            raise InputError(f"data offset: written for dataset version {state['version'][:16]}..., "
                             f"but {dataset.root} is version {dataset.version[:16]}...")
        for key, value in (("context", context), ("micro_batch", micro_batch)):
            if key in state and state[key] != value:
                raise InputError(f"data offset: written with {key} {state[key]}, asked for {value}")
        return cls(dataset, state["seed"], context, micro_batch)
