"""keel's job API (version API_VERSION): what a training job gives keel, and what keel keeps.

A scenario names its job with `[job] entry = "package.module:factory"` (or
`"path/to/file.py:factory"`, relative to the scenario's directory) and `[job.config]`. The
factory takes no argument and returns a `Job`: builders, not live objects, so keel keeps the
per-slot backward, the exact reduction over slots and the decision to step. keel calls

    model     = job.model(seed, config)              # nn.Module; its weights a function of (seed, config)
    optimizer = job.optimizer(named_params, config)  # named_params: [(name, Parameter)], trainable, model order
    scheduler = job.scheduler(optimizer, config)     # optional; stepped after every optimizer step
    extra     = job.state(model, optimizer, config)  # optional {key: Stateful}: checkpointed, sent to a spare
    job.after_step(model, optimizer, extra)          # optional, after every optimizer step (an EMA's update)
    dataset   = job.dataset(config)                  # map-style: __len__, __getitem__(int)
    loss      = job.loss(model, job.collate(samples), generator)   # a scalar tensor, per slot

where `generator` is keel's torch.Generator of (seed, step, slot), the only randomness a loss
may use (dropout: pass it on, or draw masks from it). keel's (step, slot) sampler
(runtime/data.Sampler) is the only sampler: it cuts the dataset's samples into the scenario's
`data.shards` contiguous shards and draws each slot's `workload.micro_batch` samples.

The contract (checked before any training, runtime/job_check.py; docs/job-api.md) says what
a job must be for keel to keep its trajectory bit-identical across faults and membership
changes. No `[job]`: the built-in byte-level GPT (runtime/job_gpt.py), a job like any other.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

API_VERSION = 1  # a change here changes what a checkpoint of a job holds (docs/job-api.md)


@runtime_checkable
class Stateful(Protocol):
    """State keel saves and restores by key (torch.distributed.checkpoint's Stateful): tensors
    and plain JSON values (str, int, float, bool, None, lists and dicts of them) only."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Job:
    """What a job factory returns (the module docstring says how keel calls each builder)."""
    model: Callable[[int, Mapping[str, Any]], torch.nn.Module]
    optimizer: Callable[[list[tuple[str, torch.nn.Parameter]], Mapping[str, Any]], torch.optim.Optimizer]
    loss: Callable[[torch.nn.Module, Any, torch.Generator], torch.Tensor]
    dataset: Callable[[Mapping[str, Any]], Any]
    collate: Callable[[list[Any]], Any] | None = None  # None: torch.utils.data.default_collate
    scheduler: Callable[[torch.optim.Optimizer, Mapping[str, Any]], Any] | None = None
    state: Callable[[torch.nn.Module, torch.optim.Optimizer, Mapping[str, Any]], Mapping[str, Stateful]] | None = None
    after_step: Callable[[torch.nn.Module, torch.optim.Optimizer, Mapping[str, Stateful]], None] | None = None
    # buffers the forward pass writes (BatchNorm's running statistics): "refuse" them, or
    # "discard" what a slot's forward writes (every slot starts from the same values, which stay as built)
    mutable_buffers: Literal["refuse", "discard"] = "refuse"
    api_version: int = API_VERSION


def slot_generator(seed: int, step: int, slot: int, device: str | torch.device = "cpu") -> torch.Generator:
    """keel's RNG of (seed, step, slot): the same stream whichever worker computes the slot."""
    digest = hashlib.blake2b(f"keel-slot-rng|{int(seed)}|{int(step)}|{int(slot)}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


# ----------------------------------------------------------------------------- the token-file dataset

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class TokenFile:
    """A flat binary file of token ids (uint16 or uint32, native little-endian: what
    nanoGPT-style pipelines write), memory-mapped. Sample i is the `context + 1` tokens from
    i x context: `{"input_ids": the first context, "labels": the last context}` (int64), so
    (len - 1) // context samples. `version` is the file's sha256: a checkpoint written on one
    file is not resumed on another."""

    def __init__(self, path: str | Path, context: int, dtype: str = "uint16") -> None:
        from keel.errors import InputError
        self.path = Path(path)
        if dtype not in TOKEN_DTYPES:
            raise InputError(f"{self.path}: token dtype: expected one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        if context < 1:
            raise InputError(f"{self.path}: expected a positive context, got {context}")
        try:
            self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[dtype], mode="r")
        except (OSError, ValueError) as e:
            raise InputError(f"{self.path}: cannot map the token file as {dtype} ({e})") from None
        self.context = context
        self.version = file_sha256(self.path)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.context)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        row = torch.from_numpy(np.asarray(self.tokens[i * self.context:(i + 1) * self.context + 1], dtype=np.int64))
        return {"input_ids": row[:-1], "labels": row[1:]}


def write_token_file(path: str | Path, ids: np.ndarray, dtype: str = "uint16") -> Path:
    """Write `ids` as a token file (atomically: a temporary file renamed into place)."""
    import os
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    np.asarray(ids).astype(TOKEN_DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, path)
    return path
