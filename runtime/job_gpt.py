"""The built-in job: the byte-level GPT (runtime/model.py) on the Python standard library's
source (runtime/data.py), through the job API like any other job. A scenario without `[job]`
runs it; its config is the scenario's `[model]` table plus `data.shards` (the corpus is stored
cut into that many shard files) and `data_root` (where it is kept; None: data.default_root).

    keel's entry for it: "runtime.job_gpt:job"
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import torch

from runtime.job import Job

ENTRY = "runtime.job_gpt:job"


def model_config(config: Mapping[str, Any]):
    from keel.scenario import Model
    return Model(**{f.name: config[f.name] for f in dataclasses.fields(Model) if f.name in config})


def config_of(scenario, data_root: str | None = None) -> dict[str, Any]:
    """The built-in job's config for `scenario`."""
    return {**dataclasses.asdict(scenario.model), "shards": scenario.data.shards, "data_root": data_root}


def prepare_dataset(root: str | Path | None, shards: int, progress: bool = False):
    """The versioned stdlib corpus of `shards` shards at `root` (built first if missing), verified."""
    from runtime.data import ensure_dataset
    return ensure_dataset(root, shards=shards, progress=progress)


class Windows:
    """The corpus as a map-style dataset: sample g is window g % per_shard of shard
    g // per_shard (context + 1 consecutive bytes), so keel's sampler cuts it exactly where the
    corpus's shards lie."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from runtime.data import Loader
        ds = prepare_dataset(config.get("data_root"), int(config["shards"]))
        self.loader = Loader(ds, 0, int(config["context"]), 1)  # sample(g) only: no seed, no batch
        self.version = ds.version
        self.context = self.loader.context

    def __len__(self) -> int:
        return self.loader.total

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.sample(g)


def build(seed: int, config: Mapping[str, Any]) -> torch.nn.Module:
    from runtime.model import build_model
    return build_model(model_config(config), seed)


def optimizer(named_params: list[tuple[str, torch.nn.Parameter]], config: Mapping[str, Any]) -> torch.optim.Optimizer:
    """AdamW on the plain per-tensor path (foreach and fused off: bitwise stable); weight decay
    on matrices and embeddings only (runtime.model.build_optimizer's groups)."""
    cfg = model_config(config)
    decay = [p for _, p in sorted(named_params, key=lambda np_: np_[0]) if p.dim() >= 2]
    no_decay = [p for _, p in sorted(named_params, key=lambda np_: np_[0]) if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, foreach=False, fused=False)


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    from runtime.model import slot_loss
    x, y = batch
    return slot_loss(model, x, y, torch.ones(x.shape[0], device=x.device))


def job() -> Job:
    return Job(model=build, optimizer=optimizer, loss=loss, dataset=Windows)


def check_scenario(scenario) -> None:
    """InputError for a corpus cut the built-in job cannot use (data.shards, model.context),
    named by scenario key, before the corpus is built."""
    from keel.errors import InputError
    from runtime.data import CORPUS_CAP_BYTES, SAMPLES_CONTEXT
    shards, context = scenario.data.shards, scenario.model.context
    shard_bytes = CORPUS_CAP_BYTES // shards
    if shard_bytes < 2 * SAMPLES_CONTEXT:
        raise InputError(f"{scenario.source}: key 'data.shards': expected at most "
                         f"{CORPUS_CAP_BYTES // (2 * SAMPLES_CONTEXT):,} shards of the runtime's "
                         f"{CORPUS_CAP_BYTES:,}-byte corpus, got {shards:,}")
    if (shard_bytes - 1) // context < 1:
        raise InputError(f"{scenario.source}: key 'model.context': expected a context shorter than a shard "
                         f"({shard_bytes:,} bytes with data.shards = {shards}), got {context:,}")


def warm_up() -> None:
    """One step of a tiny built-in model through the API (the fork server pays torch's one-time
    costs with it): no dataset, no global RNG touched."""
    config = {"d_model": 8, "layers": 1, "heads": 2, "context": 4, "lr": 1e-3, "weight_decay": 0.0}
    j = job()
    model = j.model(0, config)
    opt = j.optimizer(list(model.named_parameters()), config)
    x = torch.zeros((1, 4), dtype=torch.long)
    j.loss(model, (x, x), torch.Generator()).backward()
    opt.step()
