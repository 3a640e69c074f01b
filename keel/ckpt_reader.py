"""The reference reader of keel checkpoints, written from docs/checkpoint-format.md alone.

It shares no code with the writer (`runtime/checkpoint.py`) and needs no torch: the manifest
and the JSON files are read with `json`, the checksums with `hashlib`, and the safetensors
headers are parsed here (8-byte little-endian header length, JSON header, raw data).

`keel ckpt verify PATH` exits 0 when the checkpoint verifies and 1, naming the file, when it
is refused; `keel ckpt inspect PATH [--json]` shows the seven fields and their sizes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from keel.durable import read_regular
from keel.errors import InputError
from keel.rundir import print_json

FORMAT = "keel-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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
CONTEXT_KEYS = ("step", "data_offset", "config_hash", "config", "cluster_topology", "commit_sha")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
MAX_HEADER = 100 * 2**20      # bytes of a safetensors header
MAX_MANIFEST = 2**20          # bytes of a manifest (it lists six files)
DATA_FILES = tuple(dict.fromkeys(f for fs in FIELD_FILES.values() for f in fs))
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ----------------------------------------------------------------------------- safetensors

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _json(data: bytes) -> Any:
    """The format's JSON: UTF-8, no NaN or Infinity; ValueError for anything else, also for a
    document nested deeper than the parser goes."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def safetensors_header(data: bytes) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; ValueError if it is not a well-formed one."""
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER or 8 + n > len(data):
        raise ValueError(f"header length {n} runs past the end of the file ({len(data)} bytes)"
                         if 8 + n > len(data) else f"header length {n} is over the {MAX_HEADER} bytes allowed")
    try:
        header = _json(data[8:8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    spans = []
    for name, t in header.items():
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and t["dtype"] in DTYPE_BYTES
                and isinstance(t.get("shape"), list) and all(_int(d) and d >= 0 for d in t["shape"])
                and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
                and all(_int(o) and o >= 0 for o in t["data_offsets"])):
            raise ValueError(f"tensor {name!r}: malformed entry")
        begin, end = t["data_offsets"]
        if end < begin or end - begin != math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]]:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {t['shape']} of {t['dtype']}")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor {name!r}: data does not start where the previous tensor ends")
        at = end
    if at != len(data) - 8 - n:
        raise ValueError(f"data section is {len(data) - 8 - n} bytes, the tensors cover {at}")
    return header, metadata


# ----------------------------------------------------------------------------- verify

def _read(path: Path) -> tuple[dict[str, Any] | None, dict[str, bytes], list[str]]:
    """(manifest, bytes of each verified file, problems). Opens nothing but the manifest and
    the format's files inside `path`. Long on purpose: the format's checks one after another,
    written independently of the writer's reader (it is the reference)."""
    if not path.is_dir():
        return None, {}, [f"{path}: not a checkpoint directory"]
    mpath = path / MANIFEST
    try:
        manifest = _json(read_regular(mpath, MAX_MANIFEST))
    except FileNotFoundError:
        return None, {}, [f"{mpath}: missing; the checkpoint is incomplete (a save that never committed)"]
    except OSError as e:
        return None, {}, [f"{mpath}: unreadable ({e.strerror})"]
    except (ValueError, UnicodeDecodeError) as e:
        return None, {}, [f"{mpath}: unreadable ({e})"]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, {}, [f"{mpath}: not a {FORMAT} manifest"]
    if manifest.get("format_version") != FORMAT_VERSION:
        return None, {}, [f"{mpath}: format version {manifest.get('format_version')!r}; this reader reads version {FORMAT_VERSION}"]
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (ValueError, RecursionError):
        return None, {}, [f"{mpath}: not the format's JSON (nested too deeply)"]
    if manifest.get("manifest_sha256") != hashlib.sha256(canonical.encode()).hexdigest():
        return None, {}, [f"{mpath}: manifest_sha256 does not match the manifest's own content (altered)"]
    problems: list[str] = []
    if not _int(manifest.get("step")) or manifest["step"] < 0:
        problems.append(f"{mpath}: 'step' is not a non-negative integer")
    m = _STEP_DIR.match(path.name)
    if m and isinstance(manifest.get("step"), int) and int(m.group(1)) != manifest["step"]:
        problems.append(f"{mpath}: step {manifest['step']} in a directory named {path.name}")
    fields = manifest.get("fields")
    if not isinstance(fields, dict) or set(fields) != set(FIELDS):
        problems.append(f"{mpath}: 'fields' must name exactly the seven fields {', '.join(FIELDS)}")
    elif any(fields[f] != FIELD_FILES[f] for f in FIELDS):
        problems.append(f"{mpath}: 'fields' maps a field to other files than the format's")
    files = manifest.get("files")
    if not isinstance(files, dict):
        return manifest, {}, problems + [f"{mpath}: 'files' is not an object"]
    for name in sorted({f for fs in FIELD_FILES.values() for f in fs} - set(files)):
        problems.append(f"{path / name}: not listed in the manifest")
    for name in sorted(p.name for p in path.iterdir()):
        if name != MANIFEST and name not in files:
            problems.append(f"{path / name}: present but not listed in the manifest")
    blobs: dict[str, bytes] = {}
    for name in sorted(set(files) - set(DATA_FILES)):  # "../x", "/etc/x", any other name: never opened
        problems.append(f"{mpath}: lists {name!r}, which is not a file of the format")
    for name, entry in sorted(files.items()):
        if name not in DATA_FILES:
            continue
        if not isinstance(entry, dict) or not _int(entry.get("bytes")) or entry["bytes"] < 0 \
                or not _HEX64.match(str(entry.get("sha256"))):
            problems.append(f"{mpath}: malformed entry for {name!r}")
            continue
        fpath = path / name
        try:
            data = read_regular(fpath, entry["bytes"])
        except FileNotFoundError:
            problems.append(f"{fpath}: missing")
            continue
        except OSError as e:
            problems.append(f"{fpath}: unreadable ({e.strerror})")
            continue
        if len(data) != entry["bytes"]:
            problems.append(f"{fpath}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or altered)")
        elif hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{fpath}: sha256 {hashlib.sha256(data).hexdigest()[:16]}... does not match the manifest's "
                            f"{entry['sha256'][:16]}... (altered)")
        else:
            blobs[name] = data
    return manifest, blobs, problems


def _check_content(path: Path, manifest: dict[str, Any], blobs: dict[str, bytes]) -> list[str]:
    problems: list[str] = []
    for name, data in blobs.items():
        where = path / name
        if name.endswith(".safetensors"):
            try:
                safetensors_header(data)
            except ValueError as e:
                problems.append(f"{where}: not a valid safetensors file ({e})")
        elif name.endswith(".json"):
            try:
                value = _json(data)
            except (ValueError, UnicodeDecodeError) as e:
                problems.append(f"{where}: not valid JSON ({e})")
                continue
            if not isinstance(value, dict):
                problems.append(f"{where}: not a JSON object")
    if "context.json" in blobs and not problems:
        ctx = _json(blobs["context.json"])
        where = path / "context.json"
        missing = [k for k in CONTEXT_KEYS if k not in ctx]
        if missing:
            problems.append(f"{where}: missing {', '.join(missing)}")
        else:
            if not (isinstance(ctx["config_hash"], str) and _HEX64.match(ctx["config_hash"])):
                problems.append(f"{where}: config_hash is not 64 hex digits")
            if not (ctx["commit_sha"] == "unknown" or (isinstance(ctx["commit_sha"], str) and _HEX40.match(ctx["commit_sha"]))):
                problems.append(f"{where}: commit_sha is neither 40 hex digits nor \"unknown\"")
            if ctx["step"] != manifest.get("step"):
                problems.append(f"{where}: step {ctx['step']!r}, the manifest says {manifest.get('step')!r}")
            for key in ("data_offset", "cluster_topology", "config"):
                if not isinstance(ctx[key], dict):
                    problems.append(f"{where}: {key} is not a JSON object")
    if "rng_state.json" in blobs and "rng_state.safetensors" in blobs and not problems:
        rng = _json(blobs["rng_state.json"])
        tensors, _ = safetensors_header(blobs["rng_state.safetensors"])
        for key in ("python", "numpy"):
            if key not in rng:
                problems.append(f"{path / 'rng_state.json'}: no {key} state")
        if tensors.get("torch_cpu", {}).get("dtype") != "U8":
            problems.append(f"{path / 'rng_state.safetensors'}: no torch_cpu state (a U8 tensor)")
    if "optimizer_state.json" in blobs and not problems:
        meta = _json(blobs["optimizer_state.json"])
        if not isinstance(meta.get("param_groups"), list):
            problems.append(f"{path / 'optimizer_state.json'}: no param_groups list")
    return problems


def verify(path: str | Path) -> list[str]:
    """Every problem that makes the checkpoint at `path` unusable; [] when it verifies."""
    path = Path(path)
    manifest, blobs, problems = _read(path)
    if manifest is None or problems:
        return problems
    return _check_content(path, manifest, blobs)


# ----------------------------------------------------------------------------- inspect

def _compact_size(value: Any) -> int:
    return len(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def inspect(path: str | Path) -> dict[str, Any]:
    """The seven fields of a checkpoint with their sizes, plus `ok` and `problems`."""
    path = Path(path)
    problems = verify(path)
    out: dict[str, Any] = {"path": str(path), "ok": not problems, "problems": problems}
    manifest, blobs, _ = _read(path)
    if manifest is None:
        return out
    out.update(format=manifest.get("format"), format_version=manifest.get("format_version"), step=manifest.get("step"))
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}

    def file_bytes(names: list[str]) -> int:
        return sum(files[n]["bytes"] for n in names
                   if n in DATA_FILES and isinstance(files.get(n), dict) and _int(files[n].get("bytes")))

    fields: dict[str, Any] = {}
    for name in ("weights", "optimizer_state", "rng_state"):
        entry: dict[str, Any] = {"files": FIELD_FILES[name], "bytes": file_bytes(FIELD_FILES[name])}
        tensor_file = FIELD_FILES[name][0]
        if tensor_file in blobs:
            try:
                tensors, _ = safetensors_header(blobs[tensor_file])
                entry["tensors"] = len(tensors)
                entry["elements"] = sum(math.prod(t["shape"]) for t in tensors.values())
                entry["dtypes"] = sorted({t["dtype"] for t in tensors.values()})
                if name == "rng_state":
                    entry["generators"] = sorted(tensors)
            except ValueError:
                pass
        json_file = FIELD_FILES[name][1] if len(FIELD_FILES[name]) > 1 else None
        if json_file in blobs:
            try:
                meta = _json(blobs[json_file])
                if name == "optimizer_state":
                    entry["kind"] = meta.get("kind")
                    entry["param_groups"] = len(meta.get("param_groups") or [])
                else:
                    entry["generators"] = sorted(set(entry.get("generators", [])) | {k for k in meta if k != "tensor_lists"})
            except ValueError:
                pass
        fields[name] = entry
    ctx: dict[str, Any] = {}
    if "context.json" in blobs:
        try:
            ctx = _json(blobs["context.json"])
        except ValueError:
            ctx = {}
    for name in ("data_offset", "config_hash", "cluster_topology", "commit_sha"):
        if name in ctx:
            fields[name] = {"files": FIELD_FILES[name], "bytes": _compact_size(ctx[name]), "value": ctx[name]}
        else:
            fields[name] = {"files": FIELD_FILES[name], "bytes": 0, "value": None}
    out["fields"] = fields
    out["bytes"] = file_bytes(list(files)) + (path / MANIFEST).stat().st_size
    return out


# ----------------------------------------------------------------------------- CLI

def _targets(path: Path) -> list[Path]:
    """A checkpoint directory, or every `step-*` checkpoint of a run directory."""
    if not path.exists():
        raise InputError(f"{path}: no such checkpoint or run directory")
    if path.is_dir() and not (path / MANIFEST).exists():
        steps = sorted(p for p in path.iterdir() if _STEP_DIR.match(p.name))
        if steps:
            return steps
    return [path]


def cli_verify(args: argparse.Namespace) -> int:
    targets = _targets(Path(args.path))
    results = [{"path": str(t), "ok": not (p := verify(t)), "problems": p} for t in targets]
    ok = all(r["ok"] for r in results)
    if getattr(args, "json", False):
        print_json(results[0] if len(results) == 1 and results[0]["path"] == str(Path(args.path))
              else {"path": args.path, "ok": ok, "checkpoints": results})
    else:
        for r in results:
            if r["ok"]:
                print(f"ok: {r['path']}")
            else:
                for problem in r["problems"]:
                    print(f"keel: checkpoint refused: {problem}", file=sys.stderr)
    return 0 if ok else 1


def cli_inspect(args: argparse.Namespace) -> int:
    targets = _targets(Path(args.path))
    infos = [inspect(t) for t in targets]
    if getattr(args, "json", False):
        print_json(infos[0] if len(infos) == 1 else {"path": args.path, "checkpoints": infos})
    else:
        for info in infos:
            print(f"{info['path']}: {'ok' if info['ok'] else 'REFUSED'}, step {info.get('step')}, "
                  f"format {info.get('format')} v{info.get('format_version')}")
            for name, entry in (info.get("fields") or {}).items():
                extra = ""
                if "value" in entry and name in ("config_hash", "commit_sha"):
                    extra = f"  {entry['value']}"
                elif "tensors" in entry:
                    extra = f"  {entry['tensors']} tensors, {entry['elements']} elements"
                print(f"  {name:<17} {entry['bytes']:>10} bytes{extra}")
            for problem in info["problems"]:
                print(f"  problem: {problem}")
    return 0 if all(i["ok"] for i in infos) else 1
