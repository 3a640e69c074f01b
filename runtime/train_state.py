"""A process's training state as plain tensors and JSON, for the checkpoint to write: the RNG
states (python, numpy, torch) and the optimizer's state, flattened and rebuilt bit for bit."""
from __future__ import annotations

import json
import random
from typing import Any

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

def flatten_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state as tensors `state.<param index>.<key>` (CPU copies) plus JSON meta."""
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
    json.dumps(meta, allow_nan=False)  # fails here, not at write time, on a non-JSON value
    return tensors, meta


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """A `torch.optim.Optimizer.state_dict()` rebuilt from `flatten_optimizer`'s output."""
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    for idx, values in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    groups = [{k: tuple(v) if k in tk else v for k, v in g.items()} for g, tk in zip(meta["param_groups"], meta["tuple_keys"])]
    return {"state": dict(sorted(state.items())), "param_groups": groups, "kind": meta["kind"]}
