"""Jobs for tests/test_job_api.py: `good` keeps the job contract; each other factory breaks
exactly one rule of it (runtime/job_check.py)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.job import Job


class Points:
    """Map-style: point i and its class, a pure function of i."""

    def __init__(self, config) -> None:
        self.n = int(config.get("samples", 256))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return {"x": x, "y": torch.tensor(int(x.sum() > 0))}


def model(seed, config) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def optimizer(named_params, config):
    return torch.optim.SGD([p for _, p in named_params], lr=0.1, momentum=0.9)


def loss(model, batch, generator):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def good() -> Job:
    return Job(model=model, optimizer=optimizer, loss=loss, dataset=Points)


def factory_raises() -> Job:
    raise RuntimeError("no GPU quota left in this project")


def not_a_job():
    return {"model": model}


def model_raises() -> Job:
    def broken(seed, config):
        raise ValueError("hidden_size must be divisible by heads")
    return dataclasses.replace(good(), model=broken)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Points({}))


def iterable_dataset() -> Job:
    return dataclasses.replace(good(), dataset=lambda config: Stream())


def stateful_loader() -> Job:
    return dataclasses.replace(good(), dataset=lambda config: torch.utils.data.DataLoader(Points({}), batch_size=4))


def integer_parameter() -> Job:
    def with_int(seed, config):
        m = model(seed, config)
        m.register_parameter("counter", nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False))
        return m
    return dataclasses.replace(good(), model=with_int)


class Words:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return f"sentence {i}"


def batch_of_strings() -> Job:
    return dataclasses.replace(good(), dataset=lambda config: Words())


def batchnorm_model(seed, config) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def batchnorm() -> Job:
    return dataclasses.replace(good(), model=batchnorm_model)


def batchnorm_discarded() -> Job:
    return dataclasses.replace(good(), model=batchnorm_model, mutable_buffers="discard")


def global_rng_loss() -> Job:
    def noisy(model, batch, generator):  # noise from the global RNG, not keel's generator
        return F.cross_entropy(model(batch["x"]), batch["y"]) * (1.0 + 0.01 * torch.rand(()))
    return dataclasses.replace(good(), loss=noisy)


def generator_loss() -> Job:
    def noisy(model, batch, generator):  # dropout from keel's generator: reproducible
        h = model(batch["x"])
        keep = torch.rand(h.shape, generator=generator) > 0.5
        return F.cross_entropy(h * keep * 2.0, batch["y"])
    return dataclasses.replace(good(), loss=noisy)


def unseeded_model() -> Job:
    return dataclasses.replace(good(), model=lambda seed, config: nn.Linear(4, 2))


def vector_loss() -> Job:
    def per_sample(model, batch, generator):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    return dataclasses.replace(good(), loss=per_sample)


def too_small() -> Job:
    return dataclasses.replace(good(), dataset=lambda config: Points({"samples": 3}))


class PointsWithBadShard(Points):
    """Points whose samples in shard `bad_shard` (of `shards`) hold a NaN: bad data, not a bad model."""

    def __init__(self, config) -> None:
        super().__init__(config)
        per_shard = self.n // int(config["shards"])
        self.bad = range(int(config["bad_shard"]) * per_shard, (int(config["bad_shard"]) + 1) * per_shard)

    def __getitem__(self, i: int):
        item = super().__getitem__(i)
        if i in self.bad:
            item["x"] = item["x"].clone()
            item["x"][1] = float("nan")
        return item


def bad_shard() -> Job:
    return dataclasses.replace(good(), dataset=PointsWithBadShard)


def diverging() -> Job:
    def nan_loss(model, batch, generator):
        return F.cross_entropy(model(batch["x"]), batch["y"]) * float("nan")
    return dataclasses.replace(good(), loss=nan_loss)


def loss_raises() -> Job:
    def broken(model, batch, generator):
        raise ValueError("no input_ids in the batch\nsecond line of the message")
    return dataclasses.replace(good(), loss=broken)


class Ema:
    """An exponential moving average of the weights: a job's further state, updated after every step."""

    def __init__(self, model) -> None:
        self.decay, self.steps = 0.9, 0
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model) -> None:
        self.steps += 1
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.weights[n].mul_(self.decay).add_(p, alpha=1 - self.decay)

    def state_dict(self):
        return {"steps": self.steps, "weights": {n: t.clone() for n, t in self.weights.items()}}

    def load_state_dict(self, sd) -> None:
        self.steps = sd["steps"]
        self.weights = {n: t.clone() for n, t in sd["weights"].items()}


def with_ema() -> Job:
    return dataclasses.replace(good(), state=lambda model, opt, config: {"ema": Ema(model)},
                               after_step=lambda model, opt, extra: extra["ema"].update(model),
                               scheduler=lambda opt, config: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
