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

import ctypes
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from keel.durable import check_resume_dir, fsync_dir, write_synced
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
TMP_DIR = re.compile(r"^\.(?:tmp|trash)-step-\d{8}-(\d+)-[0-9a-f]+$")  # a save in progress, or a removal
MAX_MANIFEST_BYTES = 2**20    # a manifest lists six files: anything larger is not one
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header (the library refuses larger ones too)
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

def _open_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes inside its directory: a
    symbolic link (which could lead out of the checkpoint), a FIFO or device (which could
    block or never end) or a file over the limit is refused before a byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a symbolic link (a checkpoint's files must be regular files of its own)") from None
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    except ValueError:  # a NUL byte in the name
        raise CheckpointError(f"{path!r}: not a file name") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than the {limit} expected (altered or appended to)")
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew is noticed
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    finally:
        os.close(fd)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _json(data: bytes) -> Any:
    """JSON as the format allows it (no NaN/Infinity); ValueError otherwise, also for a
    document nested too deeply for the parser (a RecursionError is no message for a user)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _read_verified(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and every file's bytes, each checked against the manifest. Only the format's
    files are opened, each a regular file inside `path`, and none larger than the manifest says."""
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        raw = _open_regular(mpath, MAX_MANIFEST_BYTES)
    except CheckpointError as e:
        if str(e).endswith(": missing"):
            raise CheckpointError(f"{mpath}: manifest missing; the checkpoint is incomplete") from None
        raise
    try:
        manifest = _json(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format version {manifest.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    try:
        canonical = _canonical(body)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{mpath}: manifest not in the format's JSON (nested too deeply or not finite)") from None
    if manifest.get("manifest_sha256") != sha256(canonical).hexdigest():
        raise CheckpointError(f"{mpath}: manifest_sha256 does not match the manifest's content (altered)")
    step = manifest.get("step")
    m = STEP_DIR.match(path.name)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{mpath}: step {step!r}; expected a non-negative integer")
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{mpath}: step {step} in a directory named {path.name} (a manifest of another step)")
    if manifest.get("fields") != FIELD_FILES:
        raise CheckpointError(f"{mpath}: 'fields' must map the seven fields to the format's files")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckpointError(f"{mpath}: 'files' is not an object")
    problems = [f"{path / f}: required file not listed in the manifest" for f in FILES if f not in listed]
    # only the format's own names are ever opened: no "../x", no absolute path, no other file
    problems += [f"{mpath}: lists {name!r}, which is not a file of the format" for name in sorted(listed) if name not in FILES]
    problems += [f"{path / f}: file not listed in the manifest" for f in sorted(os.listdir(path))
                 if f != MANIFEST and f not in listed]
    blobs = {}
    for name in FILES:
        entry = listed.get(name)
        if entry is None:
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool)
                and entry["bytes"] >= 0 and isinstance(entry.get("sha256"), str)):
            problems.append(f"{mpath}: malformed entry for {name!r}")
            continue
        try:
            data = _open_regular(path / name, entry["bytes"])
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if len(data) != entry["bytes"]:
            problems.append(f"{path / name}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or altered)")
        elif sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{path / name}: sha256 does not match the manifest (altered)")
        blobs[name] = data
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest, blobs


def _safetensors(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; its header is bounded before the library sees it."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if n < 0 or n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise CheckpointError(f"{path}: not a safetensors file (header length {n} in a file of {len(data)} bytes)")
    try:
        _json(data[8:8 + n])
        return st_load(data)
    except Exception as e:  # the library's SafetensorError, or our ValueError: not a tensors file
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None


def _parse(path: Path, manifest: dict[str, Any], blobs: dict[str, bytes]) -> dict[str, Any]:
    """All seven fields from verified bytes; a CheckpointError naming the file that does not parse."""
    def json_object(name: str) -> dict[str, Any]:
        try:
            value = _json(blobs[name])
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path / name}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise CheckpointError(f"{path / name}: not a JSON object")
        return value

    weights = _safetensors(path / "weights.safetensors", blobs["weights.safetensors"])
    opt_meta = json_object("optimizer_state.json")
    opt_tensors = _safetensors(path / "optimizer_state.safetensors", blobs["optimizer_state.safetensors"])
    try:
        optimizer_state = unflatten_optimizer(opt_tensors, opt_meta)
    except Exception as e:  # checksums matched but the content is not ours
        raise CheckpointError(f"{path / 'optimizer_state.json'}: malformed optimizer state ({type(e).__name__}: {e})") from None
    rng = json_object("rng_state.json")
    rng_tensors = _safetensors(path / "rng_state.safetensors", blobs["rng_state.safetensors"])
    try:
        for key, n in rng.pop("tensor_lists", {}).items():
            rng[key] = [rng_tensors.pop(f"{key}.{i}") for i in range(n)]
    except Exception as e:
        raise CheckpointError(f"{path / 'rng_state.json'}: tensor_lists do not match rng_state.safetensors ({e})") from None
    rng.update(rng_tensors)
    missing = [k for k in ("python", "numpy", "torch_cpu") if k not in rng]
    if missing:
        raise CheckpointError(f"{path / 'rng_state.json'}: no {', '.join(missing)} state")
    context = json_object("context.json")
    missing = [k for k in ("step", "data_offset", "config_hash", "config", "cluster_topology", "commit_sha") if k not in context]
    if missing:
        raise CheckpointError(f"{path / 'context.json'}: missing {', '.join(missing)}")
    if context["step"] != manifest["step"]:
        raise CheckpointError(f"{path / 'context.json'}: step {context['step']} but the manifest says {manifest['step']}")
    for key in ("data_offset", "config", "cluster_topology"):
        if not isinstance(context[key], dict):
            raise CheckpointError(f"{path / 'context.json'}: {key} is not a JSON object")
    if not (isinstance(context["config_hash"], str) and len(context["config_hash"]) == 64 and _HEX.match(context["config_hash"])):
        raise CheckpointError(f"{path / 'context.json'}: config_hash is not 64 lowercase hex digits")
    return {"weights": weights, "optimizer_state": optimizer_state, "rng": rng, "context": context}


def _verified(path: Path) -> dict[str, Any]:
    manifest, blobs = _read_verified(path)
    return _parse(path, manifest, blobs)


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems that make `path` unusable (empty list: it verifies and every field parses)."""
    try:
        _verified(Path(path))
    except CheckpointError as e:
        return str(e).split("; ")
    return []


def find_latest(run_dir: str | Path, refused: list[tuple[Path, list[str]]] | None = None) -> Path | None:
    """The newest checkpoint under `run_dir` that verifies. Refused ones are appended to
    `refused` with their problems if it is given (the caller reports them), else logged."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for p in sorted((p for p in run_dir.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name, reverse=True):
        problems = ([f"{p}: a symbolic link (a checkpoint in a run directory must be a directory of its own)"]
                    if p.is_symlink() else verify_checkpoint(p))
        if not problems:
            return p
        if refused is not None:
            refused.append((p, problems))
        else:
            log.warning("skipping checkpoint %s: %s", p, "; ".join(problems))
    return None


def resolve_resume(resume: str | Path) -> Path:
    """`--resume DIR`: the newest complete checkpoint in DIR/checkpoints or DIR. Every newer one
    that was refused is reported on stderr with why, and with the one resumed from instead."""
    resume = check_resume_dir(resume)
    refused: list[tuple[Path, list[str]]] = []
    latest = None
    for candidate in (resume / "checkpoints", resume):
        latest = find_latest(candidate, refused)
        if latest is not None:
            break
    if latest is None:
        why = "; ".join(f"{p.name}: {'; '.join(pr)}" for p, pr in refused) if refused else "none found"
        raise InputError(f"--resume {resume}: no complete checkpoint to resume from ({why})")
    for p, problems in refused:
        print(f"keel: warning: --resume: checkpoint {p} refused: {'; '.join(problems)}", file=sys.stderr)
    if refused:
        print(f"keel: warning: --resume: falling back to {latest}, the newest complete checkpoint", file=sys.stderr)
    return latest


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
    parsed = _verified(path)
    weights, optimizer_state, rng, context = parsed["weights"], parsed["optimizer_state"], parsed["rng"], parsed["context"]
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
