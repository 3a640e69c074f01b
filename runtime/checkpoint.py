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

This module writes; runtime/checkpoint_read.py loads and runtime/checkpoint_format.py holds
the names and limits both use. Every name of the three is importable from here.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save as st_save

from keel.durable import fsync_dir, write_synced
from keel.rundir import pid_alive
from runtime.train_state import capture_rng, flatten_optimizer, restore_rng  # noqa: F401  (ck.capture_rng, ck.restore_rng)

from runtime.checkpoint_format import (FIELD_FILES, FIELDS, FILES, FORMAT, FORMAT_VERSION, HEX,  # noqa: F401
                                       MANIFEST, STEP_DIR, TMP_DIR, CheckpointError, canonical,
                                       current_commit_sha, step_dir_name)  # the format's names, here as before

log = logging.getLogger("keel.checkpoint")


# ----------------------------------------------------------------------------- writing

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
                  data_state: dict[str, Any], config_hash: str, config: dict[str, Any], topology: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> Snapshot:
    if not (isinstance(config_hash, str) and len(config_hash) == 64 and HEX.match(config_hash)):
        raise ValueError(f"config_hash: expected 64 lowercase hex digits, got {config_hash!r}")
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = flatten_optimizer(optimizer, model, extra)
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
        manifest["manifest_sha256"] = sha256(canonical(manifest)).hexdigest()
        write_synced(tmp / MANIFEST, _json_bytes(manifest))
        fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        if final.exists():  # the same step written again (a redone step): swap it in
            _replace_dir(tmp, final)
            trash = tmp  # now holds the previous copy, under a name no reader takes
        else:
            os.rename(tmp, final)
        fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    prune(run_dir, keep)
    return final


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _replace_dir(new: Path, final: Path) -> None:
    """Put directory `new` in the place of the existing directory `final`; afterwards `new`
    holds the old one. Atomic where the kernel can swap two names (Linux renameat2
    RENAME_EXCHANGE): a crash leaves one complete checkpoint of that step, never none. Elsewhere
    the old one is renamed aside first, and a crash between the two renames leaves the step to
    the previous checkpoint (with the new copy complete under `new`'s name)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        if fn(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(final))
    aside = final.parent / f".trash-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(final, aside)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(aside, final)
        raise
    os.rename(aside, new)


def save_checkpoint(run_dir: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    rng: dict[str, Any], data_state: dict[str, Any], config_hash: str, config: dict[str, Any],
                    topology: dict[str, Any], keep: int = 3, extra: dict[str, Any] | None = None,
                    before_commit: Callable[[], None] | None = None) -> Path:
    """Write a checkpoint synchronously; returns its directory."""
    snap = take_snapshot(step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                         config_hash=config_hash, config=config, topology=topology, extra=extra)
    return write_snapshot(run_dir, snap, keep, before_commit)


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, and the `.tmp-*`/`.trash-*` directories
    of writers that are no longer alive."""
    run_dir = Path(run_dir)
    removed = []
    steps = sorted((p for p in run_dir.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name)
    for p in steps[:-keep] if keep > 0 else []:
        # renamed aside first: a crash in the middle of the removal leaves no half checkpoint
        # under a checkpoint's name
        trash = run_dir / f".trash-{p.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(p)
    for p in run_dir.iterdir():
        m = TMP_DIR.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
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
                            topology: dict[str, Any], extra: dict[str, Any] | None = None) -> float:
        """Copy the state to the CPU and start writing it in the background; returns the
        seconds training was stalled (including any wait for the previous write)."""
        t0 = time.perf_counter()
        self.wait()
        snap = take_snapshot(step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                             config_hash=config_hash, config=config, topology=topology, extra=extra)
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
             data_state: dict[str, Any], config_hash: str, config: dict[str, Any], topology: dict[str, Any],
             extra: dict[str, Any] | None = None) -> Path:
        """A synchronous save (after any write in flight); raises on failure."""
        self.wait()
        path = save_checkpoint(self.run_dir, step=step, model=model, optimizer=optimizer, rng=rng, data_state=data_state,
                               config_hash=config_hash, config=config, topology=topology, keep=self.keep,
                               extra=extra)
        self.last_path = path
        return path

    close = wait



# the loading side, under the names it always had here
from runtime.checkpoint_read import (LoadedCheckpoint, apply_optimizer_state, find_latest,  # noqa: E402,F401
                                     load_checkpoint, resolve_resume, verify_checkpoint)
