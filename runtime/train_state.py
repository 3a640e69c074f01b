"""A process's training state as plain tensors and JSON, for the checkpoint to write: the RNG
states (python, numpy, torch) and the optimizer's state, flattened and rebuilt bit for bit."""
from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Mapping

import numpy as np
import torch


# ----------------------------------------------------------------------------- RNG state

def capture_rng() -> dict[str, Any]:
    """The process's RNG states: python and numpy as JSON-able dicts, torch CPU (and CUDA,
    where initialized) as uint8 tensors."""
    version, mt, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [t.cpu() for t in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(d: dict[str, Any]) -> None:
    """Inverse of `capture_rng` (extra keys such as `loader` are ignored)."""
    py = d["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = d["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(d["torch_cpu"])
    if d.get("torch_cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["torch_cuda"])


# ----------------------------------------------------------------------------- optimizer state

def flatten_tree(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A state dict (nested dicts, lists and tuples of tensors and JSON values) as JSON: each
    tensor moved into `tensors` under `prefix.<path>` (a CPU copy) and replaced by
    {"__tensor__": that key}; a tuple by {"__tuple__": [...]}, a dict with non-string keys by
    {"__items__": [[key, value], ...]}."""
    if torch.is_tensor(obj):
        tensors[prefix] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_tree(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[k, flatten_tree(v, f"{prefix}.{i}", tensors)] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [flatten_tree(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    return obj


def unflatten_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_tree`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]].clone()
        if set(obj) == {"__tuple__"}:
            return tuple(unflatten_tree(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: unflatten_tree(v, tensors) for k, v in obj["__items__"]}
        return {k: unflatten_tree(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_tree(v, tensors) for v in obj]
    return obj


def flatten_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                      extra: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state as tensors `state.<param index>.<key>` (CPU copies) plus JSON meta; a
    job's further state (`extra`, {key: Stateful}) as tensors `extra.<key>...` and meta["extra"]."""
    sd = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    groups, tuple_keys = [], []
    for g in sd["param_groups"]:
        groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in g.items()})
        tuple_keys.append(sorted(k for k, v in g.items() if isinstance(v, tuple)))
    meta = {"kind": type(optimizer).__name__, "param_groups": groups, "tuple_keys": tuple_keys, "scalars": scalars,
            "param_names": [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]}
    if extra:
        meta["extra"] = {key: flatten_tree(s.state_dict(), f"extra.{key}", tensors) for key, s in sorted(extra.items())}
    json.dumps(meta, allow_nan=False)  # fails here, not at write time, on a non-JSON value
    return tensors, meta


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """A `torch.optim.Optimizer.state_dict()` rebuilt from `flatten_optimizer`'s output."""
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("extra."):
            continue
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    for idx, values in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    groups = [{k: tuple(v) if k in tk else v for k, v in g.items()} for g, tk in zip(meta["param_groups"], meta["tuple_keys"])]
    out = {"state": dict(sorted(state.items())), "param_groups": groups, "kind": meta["kind"]}
    if meta.get("extra"):
        out["extra"] = {key: unflatten_tree(tree, tensors) for key, tree in meta["extra"].items()}
    return out


def load_extra(extra: dict[str, Any], stored: dict[str, Any] | None, where: str) -> None:
    """Restore a job's further state (`extra`, {key: Stateful}) from `stored` (unflatten_optimizer's
    "extra"); the keys must match."""
    stored = stored or {}
    if set(stored) != set(extra):
        raise ValueError(f"{where}: holds the job state {sorted(stored)}, the job registers {sorted(extra)}")
    for key, s in extra.items():
        s.load_state_dict(stored[key])


# ----------------------------------------------------------------------------- hashing

def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (contiguous, on the CPU, native little-endian)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_sha256(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 over the weights in sorted-name order: for each tensor, its name, dtype and shape
    (as `name\\0dtype\\0d0,d1,...\\0`) then its bytes."""
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{','.join(map(str, t.shape))}\0".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()
