"""Loading a checkpoint (runtime/checkpoint.py writes them; docs/checkpoint-format.md): every
file read once without following links, bounded by the size its manifest lists, checked
against the manifest, and only then parsed; all seven fields or a CheckpointError naming the
file. `find_latest` and `resolve_resume` choose what a resume loads, and say what they refused.
"""
from __future__ import annotations


import errno
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from keel.durable import check_resume_dir, read_regular
from runtime.train_state import unflatten_optimizer
from keel.errors import InputError
from keel.scenario import diff_configs

from runtime.checkpoint_format import (FIELD_FILES, FILES, FORMAT, FORMAT_VERSION, HEX, MANIFEST,
                                       MAX_HEADER_BYTES, MAX_MANIFEST_BYTES, STEP_DIR, CheckpointError, canonical,
                                       current_commit_sha)

log = logging.getLogger("keel.checkpoint")

# ----------------------------------------------------------------------------- optimizer state

def apply_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any],
                          extra: dict[str, Any] | None = None) -> None:
    """Restore `state` (LoadedCheckpoint.optimizer_state) into `optimizer`, bit for bit, and
    the job's further state into `extra` ({key: Stateful}) where given."""
    if state.get("kind") not in (None, type(optimizer).__name__):
        raise CheckpointError(f"optimizer_state: written by {state['kind']}, cannot restore into {type(optimizer).__name__}")
    sd = {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in state["state"].items()},
          "param_groups": [dict(g) for g in state["param_groups"]]}
    optimizer.load_state_dict(sd)
    if extra is not None:
        from runtime.train_state import load_extra
        try:
            load_extra(extra, state.get("extra"), "optimizer_state")
        except ValueError as e:
            raise CheckpointError(str(e)) from None


# ----------------------------------------------------------------------------- reading

def _open_regular(path: Path, limit: int) -> bytes:
    """keel.durable.read_regular's bytes of `path` (a regular file of at most `limit` bytes,
    no link followed), or a CheckpointError naming the file."""
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a symbolic link (a checkpoint's files must be regular files of its own)") from None
        if e.errno in (errno.EINVAL, errno.EFBIG):  # read_regular's own refusals say why
            raise CheckpointError(f"{path}: {e.strerror}") from None
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None


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
    files are opened, each a regular file inside `path`, and none larger than the manifest says.
    Long on purpose: the manifest's checks one after another, in the order
    docs/checkpoint-format.md lists them, each with the message that names the file."""
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.lexists(mpath):
        raise CheckpointError(f"{mpath}: manifest missing; the checkpoint is incomplete")
    raw = _open_regular(mpath, MAX_MANIFEST_BYTES)
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
        canon = canonical(body)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{mpath}: manifest not in the format's JSON (nested too deeply or not finite)") from None
    if manifest.get("manifest_sha256") != sha256(canon).hexdigest():
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
    if not (isinstance(context["config_hash"], str) and len(context["config_hash"]) == 64 and HEX.match(context["config_hash"])):
        raise CheckpointError(f"{path / 'context.json'}: config_hash is not 64 lowercase hex digits")
    from runtime.job import API_VERSION
    written = context["data_offset"].get("job_api", 1)  # before the job API: the built-in job, as version 1
    if written != API_VERSION:
        raise CheckpointError(f"{path / 'context.json'}: written under job API version {written!r}, this keel speaks "
                              f"{API_VERSION} (its sampler, slot RNG or state layout differ: docs/job-api.md); "
                              f"resume it with the keel that wrote it")
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


def find_latest(run_dir: str | Path, refused: list[tuple[Path, list[str]]] | None = None,
                at_most: int | None = None) -> Path | None:
    """The newest checkpoint under `run_dir` that verifies (of a step <= `at_most`, if given).
    Refused ones are appended to `refused` with their problems if it is given (the caller
    reports them), else logged."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for p in sorted((p for p in run_dir.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name, reverse=True):
        if at_most is not None and int(p.name.split("-")[1]) > at_most:
            continue
        problems = ([f"{p}: a symbolic link (a checkpoint in a run directory must be a directory of its own)"]
                    if p.is_symlink() else verify_checkpoint(p))
        if not problems:
            return p
        if refused is not None:
            refused.append((p, problems))
        else:
            log.warning("skipping checkpoint %s: %s", p, "; ".join(problems))
    return None


def newest_in_run(run_dir: str | Path, refused: list | None = None) -> Path | None:
    """The newest complete checkpoint of a run directory: in DIR/checkpoints, or DIR itself
    when it holds the checkpoints; None if there is none (`refused` collects the newer ones
    that were refused, with why)."""
    run_dir = Path(run_dir)
    refused = [] if refused is None else refused
    for candidate in (run_dir / "checkpoints", run_dir):
        latest = find_latest(candidate, refused)
        if latest is not None:
            return latest
    return None


def resolve_resume(resume: str | Path) -> Path:
    """`--resume DIR`: the newest complete checkpoint in DIR/checkpoints or DIR. Every newer one
    that was refused is reported on stderr with why, and with the one resumed from instead."""
    resume = check_resume_dir(resume)
    refused: list[tuple[Path, list[str]]] = []
    latest = newest_in_run(resume, refused)
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

    def apply_to(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        """Restore weights (and optimizer state, and a job's further state) bit for bit."""
        model.load_state_dict(self.weights, strict=True)
        if optimizer is not None:
            apply_optimizer_state(optimizer, self.optimizer_state, extra)


def load_checkpoint(path: str | Path, *, config_hash: str | None = None, config: dict[str, Any] | None = None,
                    allow_config_change: bool = False, log_warnings: bool = True) -> LoadedCheckpoint:
    """Verify, then load all seven fields. A config hash other than `config_hash` is refused
    with what changed (unless `allow_config_change`); another commit SHA is a warning (logged,
    unless the caller says them itself: `log_warnings=False`; they are in `.warnings`)."""
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
    for w in warnings if log_warnings else ():
        log.warning("%s", w)
    return LoadedCheckpoint(step=context["step"], weights=weights, optimizer_state=optimizer_state, rng=rng,
                            data_state=context["data_offset"], config_hash=stored, config=context["config"],
                            topology=context["cluster_topology"], commit_sha=context["commit_sha"], path=path,
                            warnings=warnings)
