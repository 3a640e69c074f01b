"""The seven-field checkpoint: written together, loaded together (docs/checkpoint-format.md).

Fields: weights, optimizer_state, rng_state, data_offset, config_hash, cluster_topology,
commit_sha. Tensors go to safetensors files, the rest to JSON; nothing is pickled, so nothing
on the load path can run code.

Commit protocol: every file is written into `.tmp-step-NNNNNNNN-...` next to the final
directory and fsynced; `manifest.json` (format version, step, sha256 and size of every file) is
written last and fsynced; the directory is renamed to `step-NNNNNNNN` and the parent fsynced.
A directory counts as a checkpoint only when its manifest verifies, so a crash at any point of
a save leaves nothing that `find_latest` picks up. Loading reads every file once, checks it
against the manifest, and only then parses it: all seven fields or an error.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from keel.durable import fsync_dir, write_synced
from runtime.train_state import capture_rng, flatten_optimizer, restore_rng, unflatten_optimizer  # noqa: F401
from keel.errors import InputError
from keel.scenario import diff_configs

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
TMP_DIR = re.compile(r"^\.tmp-step-\d{8}-(\d+)-[0-9a-f]+$")
REPO_ROOT = Path(__file__).resolve().parents[1]
_HEX = re.compile(r"^[0-9a-f]+$")

log = logging.getLogger("keel.checkpoint")


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@functools.lru_cache(maxsize=1)
def current_commit_sha() -> str:
    """40 hex of the code's git HEAD, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if len(out) == 40 and _HEX.match(out) else "unknown"


# ----------------------------------------------------------------------------- optimizer state

def apply_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore `state` (LoadedCheckpoint.optimizer_state) into `optimizer`, bit for bit."""
    if state.get("kind") not in (None, type(optimizer).__name__):
        raise CheckpointError(f"optimizer_state: written by {state['kind']}, cannot restore into {type(optimizer).__name__}")
    sd = {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in state["state"].items()},
          "param_groups": [dict(g) for g in state["param_groups"]]}
    optimizer.load_state_dict(sd)


# ----------------------------------------------------------------------------- writing

def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()




def _split_tensors(d: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, rest = {}, {}
    for key, value in d.items():
        if torch.is_tensor(value):
            tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        elif isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            for i, v in enumerate(value):
                tensors[f"{key}.{i}"] = v.detach().to("cpu", copy=True).contiguous()
            rest.setdefault("tensor_lists", {})[key] = len(value)
        else:
            rest[key] = value
    return tensors, rest


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied to the CPU: taking one is the only part of a save
    that must happen at a step boundary."""
    step: int
    weights: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]
    rng_meta: dict[str, Any]
    context: dict[str, Any]


def take_snapshot(*, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any],
                  data_state: dict[str, Any], config_hash: str, config: dict[str, Any], topology: dict[str, Any]) -> Snapshot:
    if not (isinstance(config_hash, str) and len(config_hash) == 64 and _HEX.match(config_hash)):
        raise ValueError(f"config_hash: expected 64 lowercase hex digits, got {config_hash!r}")
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = flatten_optimizer(optimizer, model)
    rng_tensors, rng_meta = _split_tensors(rng)
    rng_meta.setdefault("loader", {"stateless": True, "sampler": data_state.get("sampler"), "version": data_state.get("version"),
                                   "seed": data_state.get("seed"), "step": data_state.get("step"),
                                   "per_slot": "no generator state: each slot's samples are drawn from "
                                               "blake2b-64(version|seed|step|slot|sample|attempt)"})
    context = json.loads(json.dumps({
        "step": int(step), "data_offset": data_state, "config_hash": config_hash, "config": config,
        "cluster_topology": topology, "commit_sha": current_commit_sha()}, allow_nan=False))  # a deep copy
    return Snapshot(int(step), weights, opt_tensors, opt_meta, rng_tensors, json.loads(json.dumps(rng_meta)), context)


def _serialize(s: Snapshot) -> dict[str, bytes]:
    return {
        "weights.safetensors": st_save(s.weights, metadata={"keel.field": "weights"}),
        "optimizer_state.safetensors": st_save(s.optimizer_tensors, metadata={"keel.field": "optimizer_state"}),
        "optimizer_state.json": _json_bytes(s.optimizer_meta),
        "rng_state.safetensors": st_save(s.rng_tensors, metadata={"keel.field": "rng_state"}),
        "rng_state.json": _json_bytes(s.rng_meta),
        "context.json": _json_bytes(s.context),
    }


def write_snapshot(run_dir: str | Path, snapshot: Snapshot, keep: int = 3,
                   before_commit: Callable[[], None] | None = None) -> Path:
    """Commit a snapshot as `run_dir/step-NNNNNNNN` (the protocol above), then keep the newest
    `keep`. `before_commit` runs once every file is written and fsynced, before the rename that
    commits them (the emulated cluster waits out its storage's write time there)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    files = _serialize(snapshot)
    final = run_dir / step_dir_name(snapshot.step)
    tmp = run_dir / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    trash = None
    try:
        for name, data in files.items():
            write_synced(tmp / name, data)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": snapshot.step,
                    "created_unix_ms": int(time.time() * 1000), "fields": FIELD_FILES,
                    "files": {name: {"sha256": sha256(data).hexdigest(), "bytes": len(data)} for name, data in files.items()}}
        manifest["manifest_sha256"] = sha256(_canonical(manifest)).hexdigest()
        write_synced(tmp / MANIFEST, _json_bytes(manifest))
        fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        if final.exists():  # the same step written again (a redone step): replace it
            trash = run_dir / f".trash-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    prune(run_dir, keep)
    return final


def save_checkpoint(run_dir: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    rng: dict[str, Any], data_state: dict[str, Any], config_hash: str, config: dict[str, Any],
                    topology: dict[str, Any], keep: int = 3,
                    before_commit: Callable[[], None] | None = None) -> Path:
    """Write a checkpoint synchronously; returns its directory."""
    snap = take_snapshot(step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                         config_hash=config_hash, config=config, topology=topology)
    return write_snapshot(run_dir, snap, keep, before_commit)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, and temp directories of dead writers."""
    run_dir = Path(run_dir)
    removed = []
    steps = sorted((p for p in run_dir.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name)
    for p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in run_dir.iterdir():
        m = TMP_DIR.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class AsyncCheckpointer:
    """Snapshot at a step boundary (the stall), write in a background thread while training
    goes on. One write in flight at a time: a new snapshot first waits for the previous write.

    `on_done(step, path, write_s, error)` is called from the writer thread when a write ends."""

    def __init__(self, run_dir: str | Path, keep: int = 3,
                 on_done: Callable[[int, Path | None, float, BaseException | None], None] | None = None,
                 before_commit: Callable[[int], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.on_done = on_done
        self.before_commit = before_commit  # called with the step, in the writer thread (write_snapshot)
        self.last_error: BaseException | None = None
        self.last_path: Path | None = None
        self.history: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None

    def snapshot_and_submit(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any],
                            data_state: dict[str, Any], config_hash: str, config: dict[str, Any],
                            topology: dict[str, Any]) -> float:
        """Copy the state to the CPU and start writing it in the background; returns the
        seconds training was stalled (including any wait for the previous write)."""
        t0 = time.perf_counter()
        self.wait()
        snap = take_snapshot(step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                             config_hash=config_hash, config=config, topology=topology)
        stall = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(snap, stall), name=f"keel-ckpt-{step}")
        self._thread.start()
        return stall

    def _write(self, snap: Snapshot, stall: float) -> None:
        t0 = time.perf_counter()
        path, error = None, None
        try:
            hook = self.before_commit
            path = write_snapshot(self.run_dir, snap, self.keep,
                                  None if hook is None else (lambda: hook(snap.step)))
            self.last_path = path
        except BaseException as e:  # recorded, decided on by the caller
            error = e
            self.last_error = e
            log.error("checkpoint at step %d failed: %s", snap.step, e)
        write_s = time.perf_counter() - t0
        self.history.append({"step": snap.step, "path": str(path) if path else None, "stall_s": stall,
                             "write_s": write_s, "error": repr(error) if error else None})
        if self.on_done is not None:
            self.on_done(snap.step, path, write_s, error)

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the write in flight (if any) ends; returns the last committed path."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None
        return self.last_path

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any],
             data_state: dict[str, Any], config_hash: str, config: dict[str, Any], topology: dict[str, Any]) -> Path:
        """A synchronous save (after any write in flight); raises on failure."""
        self.wait()
        path = save_checkpoint(self.run_dir, step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                               config_hash=config_hash, config=config, topology=topology, keep=self.keep)
        self.last_path = path
        return path

    close = wait


# ----------------------------------------------------------------------------- reading

def _read_verified(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and every file's bytes, each checked against the manifest."""
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        manifest = json.loads(mpath.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: manifest missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format version {manifest.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != sha256(_canonical(body)).hexdigest():
        raise CheckpointError(f"{mpath}: manifest_sha256 does not match the manifest's content (altered)")
    listed = manifest.get("files") or {}
    problems = [f"{path / f}: required file not listed in the manifest" for f in FILES if f not in listed]
    problems += [f"{path / f}: file not listed in the manifest" for f in sorted(os.listdir(path))
                 if f != MANIFEST and f not in listed]
    blobs = {}
    for name, entry in sorted(listed.items()):
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)) \
                or "/" in name or name.startswith("."):
            problems.append(f"{mpath}: malformed entry for {name!r}")
            continue
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            problems.append(f"{path / name}: missing")
            continue
        if len(data) != entry["bytes"]:
            problems.append(f"{path / name}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or altered)")
        elif sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{path / name}: sha256 does not match the manifest (altered)")
        blobs[name] = data
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest, blobs


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems that make `path` unusable (empty list: it verifies)."""
    try:
        _read_verified(Path(path))
    except CheckpointError as e:
        return str(e).split("; ")
    return []


def find_latest(run_dir: str | Path, refused: list[tuple[Path, list[str]]] | None = None) -> Path | None:
    """The newest checkpoint under `run_dir` whose manifest and checksums verify. Refused ones
    are logged and, if `refused` is given, appended to it with their problems."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for p in sorted((p for p in run_dir.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name, reverse=True):
        problems = verify_checkpoint(p)
        if not problems:
            return p
        log.warning("skipping checkpoint %s: %s", p, "; ".join(problems))
        if refused is not None:
            refused.append((p, problems))
    return None


@dataclass
class LoadedCheckpoint:
    step: int
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: dict[str, Any]
    data_state: dict[str, Any]
    config_hash: str
    config: dict[str, Any]
    topology: dict[str, Any]
    commit_sha: str
    path: Path
    warnings: list[str] = field(default_factory=list)

    def apply_to(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore weights (and optimizer state) bit for bit."""
        model.load_state_dict(self.weights, strict=True)
        if optimizer is not None:
            apply_optimizer_state(optimizer, self.optimizer_state)


def load_checkpoint(path: str | Path, *, config_hash: str | None = None, config: dict[str, Any] | None = None,
                    allow_config_change: bool = False) -> LoadedCheckpoint:
    """Verify, then load all seven fields. A config hash other than `config_hash` is refused
    with what changed (unless `allow_config_change`); another commit SHA is a warning."""
    path = Path(path)
    manifest, blobs = _read_verified(path)
    try:
        weights = st_load(blobs["weights.safetensors"])
        opt_meta = json.loads(blobs["optimizer_state.json"])
        optimizer_state = unflatten_optimizer(st_load(blobs["optimizer_state.safetensors"]), opt_meta)
        rng = json.loads(blobs["rng_state.json"])
        rng_tensors = st_load(blobs["rng_state.safetensors"])
        for key, n in rng.pop("tensor_lists", {}).items():
            rng[key] = [rng_tensors.pop(f"{key}.{i}") for i in range(n)]
        rng.update(rng_tensors)
        context = json.loads(blobs["context.json"])
        missing = [k for k in ("step", "data_offset", "config_hash", "config", "cluster_topology", "commit_sha") if k not in context]
    except (ValueError, KeyError, TypeError) as e:  # checksums matched but the content is not ours
        raise CheckpointError(f"{path}: malformed checkpoint content ({e})") from None
    if missing:
        raise CheckpointError(f"{path / 'context.json'}: missing {', '.join(missing)}")
    if context["step"] != manifest["step"]:
        raise CheckpointError(f"{path / 'context.json'}: step {context['step']} but the manifest says {manifest['step']}")
    warnings = []
    stored = context["config_hash"]
    if config_hash is not None and stored != config_hash:
        changes = diff_configs(context["config"], config) if config is not None else []
        what = "; ".join(changes) if changes else "the configurations differ"
        message = (f"{path}: written for config hash {stored[:12]}..., the scenario's is {config_hash[:12]}...; "
                   f"changed: {what}")
        if not allow_config_change:
            raise CheckpointError(message + " (pass --allow-config-change to resume anyway)")
        warnings.append(message)
    here = current_commit_sha()
    if context["commit_sha"] != here:
        warnings.append(f"{path}: written by commit {context['commit_sha']}, this code is {here}")
    for w in warnings:
        log.warning("%s", w)
    return LoadedCheckpoint(step=context["step"], weights=weights, optimizer_state=optimizer_state, rng=rng,
                            data_state=context["data_offset"], config_hash=stored, config=context["config"],
                            topology=context["cluster_topology"], commit_sha=context["commit_sha"], path=path,
                            warnings=warnings)
