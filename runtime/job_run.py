"""A scenario's job, resolved and bound to a process: what the worker, the fork server, the
emulation, the capacity check and the contract check all use (runtime/job.py is the API).

    spec = load_spec(scenario, data_root)     # the entry imported, its factory called
    bound = BoundJob(spec, scenario, device)  # model, optimizer, scheduler, extra state, loader
    vector, batch = bound.slot_vector(step, slot, quarantine, poisoned)
    bound.apply(mean)                         # the reduced gradient in, one optimizer step
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from keel.errors import InputError
from runtime.job import API_VERSION, Job, slot_generator


class JobError(InputError):
    """A job that breaks the API's contract: one line naming the job, the rule and what to do."""

    def __init__(self, name: str, rule: str, message: str) -> None:
        super().__init__(" ".join(f"job {name}: {rule}: {message}".split()))  # one line, whatever the message
        self.rule = rule


@dataclass(frozen=True)
class JobSpec:
    name: str                 # the entry, as the scenario gives it
    job: Job
    config: Mapping[str, Any]
    builtin: bool


def _entry_file(target: str, base: Path) -> Path | None:
    """The file of a 'path/to/file.py' entry (relative to `base`), None for a module entry."""
    if not (target.endswith(".py") or "/" in target):
        return None
    path = Path(target)
    return path if path.is_absolute() else base / path


def _exec_file(path: Path, name: str, keep: bool) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if not keep:
            del sys.modules[name]
    return module


def _import_entry(entry: str, base: Path) -> Any:
    target, _, attr = entry.rpartition(":")
    path = _entry_file(target, base)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        name = "keel_job_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        module = sys.modules.get(name)
        if module is None:
            try:
                module = _exec_file(path, name, keep=True)
            except BaseException:
                sys.modules.pop(name, None)
                raise
    else:
        module = importlib.import_module(target)
    if not hasattr(module, attr):
        raise AttributeError(f"{target} has no attribute {attr!r}")
    return getattr(module, attr)


def warm_import(entry: str, base: str | Path) -> None:
    """Import what the job's module imports (its libraries), for the fork server to preload:
    a file entry runs under a throwaway name, not kept, so each worker still runs the job's
    file as it is on disk."""
    target = entry.rpartition(":")[0]
    path = _entry_file(target, Path(base))
    if path is None:
        importlib.import_module(target)
    elif path.is_file():
        _exec_file(path, "keel_job_preload", keep=False)


def scenario_dir(scenario) -> Path:
    """Where a file entry is found: the scenario file's directory (absolute), else this directory."""
    source = Path(scenario.source)
    return (source.parent if source.suffix == ".toml" else Path.cwd()).resolve()


def load_spec(scenario, data_root: str | None = None, job_dir: str | None = None) -> JobSpec:
    """The scenario's job: `[job].entry`'s factory called (a file entry found in `job_dir`,
    default the scenario's directory), or the built-in GPT. JobError, with the factory's own
    message, when the entry is missing or its factory raises."""
    from runtime import job_gpt
    if not scenario.job.entry:
        return JobSpec("builtin GPT (runtime.job_gpt)", job_gpt.job(), job_gpt.config_of(scenario, data_root), True)
    entry = scenario.job.entry
    try:
        factory = _import_entry(entry, Path(job_dir) if job_dir else scenario_dir(scenario))
    except Exception as e:
        raise JobError(entry, "the entry must import", f"{type(e).__name__}: {e}; check [job] entry "
                       f"('package.module:factory', or 'file.py:factory' relative to the scenario)") from None
    try:
        job = factory()
    except Exception as e:
        raise JobError(entry, "the factory must return a Job", f"it raised {type(e).__name__}: {e}") from None
    if not isinstance(job, Job):
        raise JobError(entry, "the factory must return a Job", f"it returned {type(job).__name__}; "
                       f"return runtime.job.Job(model=..., optimizer=..., loss=..., dataset=...)")
    if job.api_version != API_VERSION:
        raise JobError(entry, "the job API version must match", f"the job was written for version "
                       f"{job.api_version}, this keel speaks {API_VERSION} (docs/job-api.md)")
    return JobSpec(entry, job, dict(scenario.job.config), False)


def to_device(batch: Any, device: str) -> Any:
    if device == "cpu":
        return batch
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return type(batch)(to_device(v, device) for v in batch)


@dataclass(frozen=True)
class SlotBatch:
    data: Any                  # the collated batch the loss sees
    shards: tuple[int, ...]    # the shard of each sample
    poisoned: tuple[bool, ...]  # sample from a poisoned shard (an injected data fault)


class SlotLoader:
    """The job's dataset under keel's (step, slot) sampler (runtime/data.Sampler)."""

    def __init__(self, dataset: Any, version: str, seed: int, shards: int, micro_batch: int, collate) -> None:
        from runtime.data import Sampler
        self.dataset, self.version, self.seed, self.shards = dataset, version, int(seed), shards
        self.per_shard = len(dataset) // shards
        self.micro_batch = micro_batch
        self.sampler = Sampler(version, seed, self.per_shard, shards, micro_batch) if self.per_shard else None
        self.collate = collate

    def batch(self, step: int, slot: int, quarantine: Iterable[int] = frozenset(),
              poisoned: frozenset[int] = frozenset()) -> SlotBatch:
        g = self.sampler.indices(step, slot, quarantine)
        shards = tuple(i // self.per_shard for i in g)
        return SlotBatch(self.collate([self.dataset[i] for i in g]), shards, tuple(s in poisoned for s in shards))

    def state(self, step: int, quarantine: Iterable[int] = frozenset()) -> dict[str, Any]:
        """The checkpoint's data offset: `step` is the number of steps committed."""
        from runtime.data import LOADER_FORMAT, SAMPLER
        out = {"format": LOADER_FORMAT, "sampler": SAMPLER, "version": self.version, "seed": self.seed,
               "step": int(step), "quarantine": sorted(int(q) for q in quarantine),
               "micro_batch": self.micro_batch, "shards": self.shards, "job_api": API_VERSION}
        if hasattr(self.dataset, "context"):
            out["context"] = int(self.dataset.context)
        else:
            out["samples_per_shard"] = self.per_shard
        return out


def dataset_version(spec: JobSpec, dataset: Any) -> str:
    """The dataset's own `version` (a content hash), else one of the job's entry and config
    (its dataset builder is a function of them)."""
    from keel.scenario_base import canonical_json
    own = getattr(dataset, "version", None)
    if isinstance(own, str) and own:
        return own
    return hashlib.sha256(canonical_json({"entry": spec.name, "config": spec.config, "samples": len(dataset)}).encode()).hexdigest()


def built(spec: JobSpec, what: str, builder, *args, rule: str | None = None) -> Any:
    """`builder(*args)`; its exception as a JobError naming the job and the builder (or `rule`)."""
    try:
        return builder(*args)
    except InputError:
        raise
    except Exception as e:
        raise JobError(spec.name, rule or f"the {what} builder must succeed", f"it raised {type(e).__name__}: {e}") from None


def check_map_style(spec: JobSpec, dataset: Any, shards: int) -> None:
    """A dataset keel's sampler can cut by (step, slot): map-style, at least a sample a shard."""
    from torch.utils.data import DataLoader, IterableDataset
    if isinstance(dataset, (IterableDataset, DataLoader)) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise JobError(spec.name, "the dataset must be map-style", f"it is a {type(dataset).__name__}: an iterable "
                       f"dataset or a loader has a position keel cannot re-split by slot after a membership change; "
                       f"return an object with __len__ and __getitem__(int) and let keel sample")
    if len(dataset) // shards < 1:
        raise JobError(spec.name, "every shard must hold a sample", f"the dataset's {len(dataset)} samples are fewer "
                       f"than data.shards ({shards}); use fewer shards or more data")


class BoundJob:
    """One process's instance of the job: built from the seed and config alone."""

    def __init__(self, spec: JobSpec, scenario, device: str = "cpu") -> None:
        from torch.utils.data import default_collate
        job, config = spec.job, spec.config
        self.spec, self.device, self.seed = spec, device, scenario.run.seed
        self.dataset = built(spec, "dataset", job.dataset, config)
        check_map_style(spec, self.dataset, scenario.data.shards)
        self.loader = SlotLoader(self.dataset, dataset_version(spec, self.dataset), self.seed, scenario.data.shards,
                                 scenario.workload.micro_batch, job.collate or default_collate)
        self.model = built(spec, "model", job.model, self.seed, config)
        if not isinstance(self.model, torch.nn.Module):
            raise JobError(spec.name, "the model builder must return an nn.Module", f"it returned {type(self.model).__name__}")
        wrong = [n for n, p in self.model.named_parameters() if not p.is_floating_point()]
        if wrong:
            raise JobError(spec.name, "parameters must be floating tensors", f"parameter {wrong[0]} is "
                           f"{self.model.get_parameter(wrong[0]).dtype}; keep integer state in a buffer")
        if device != "cpu":
            self.model.to(device)
        self.model.train()
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not self.named:
            raise JobError(spec.name, "the model must have trainable parameters", "none requires grad")
        self.params = [p for _, p in self.named]
        self.sizes = tuple(p.numel() for p in self.params)
        self.optimizer = built(spec, "optimizer", job.optimizer, self.named, config)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise JobError(spec.name, "the optimizer builder must return a torch.optim.Optimizer",
                           f"it returned {type(self.optimizer).__name__}")
        self.scheduler = built(spec, "scheduler", job.scheduler, self.optimizer, config) if job.scheduler else None
        extra = built(spec, "state", job.state, self.model, self.optimizer, config) if job.state else {}
        self.extra: dict[str, Any] = dict(extra)
        if self.scheduler is not None:
            if "scheduler" in self.extra:
                raise JobError(spec.name, "state keys must be unique", "'scheduler' is the scheduler's key; rename yours")
            self.extra["scheduler"] = self.scheduler
        from runtime.job import Stateful
        for key, value in self.extra.items():
            if not isinstance(value, Stateful):
                raise JobError(spec.name, "further state must be Stateful", f"state {key!r} is a {type(value).__name__} "
                               f"without state_dict/load_state_dict")
        self.discard_buffers = job.mutable_buffers == "discard"

    def buffers(self) -> dict[str, torch.Tensor]:
        params = {n for n, _ in self.model.named_parameters()}
        return {n: t for n, t in self.model.state_dict(keep_vars=True).items() if n not in params}

    def slot_loss(self, step: int, slot: int, quarantine: Iterable[int] = frozenset(),
                  poisoned: frozenset[int] = frozenset()) -> tuple[torch.Tensor, SlotBatch]:
        """The slot's loss at `step` (its graph kept for the backward)."""
        b = self.loader.batch(step, slot, quarantine, poisoned)
        loss = self.spec.job.loss(self.model, to_device(b.data, self.device), slot_generator(self.seed, step, slot, self.device))
        if any(b.poisoned):  # an injected data fault: every value of this slot becomes NaN
            loss = loss * math.nan
        return loss, b

    def slot_vector(self, step: int, slot: int, quarantine: Iterable[int] = frozenset(),
                    poisoned: frozenset[int] = frozenset()) -> tuple[torch.Tensor, SlotBatch]:
        """Forward and backward of (step, slot): the flat float32 gradient with the loss
        appended (on the CPU), and the batch it saw."""
        saved = {n: t.detach().clone() for n, t in self.buffers().items()} if self.discard_buffers else None
        self.model.zero_grad(set_to_none=True)
        loss, b = self.slot_loss(step, slot, quarantine, poisoned)
        loss.backward()
        if saved:
            with torch.no_grad():
                for n, t in self.buffers().items():
                    t.copy_(saved[n])
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params]
        return torch.cat(grads + [loss.detach().reshape(1).float()]).cpu(), b

    def suspect_shards(self, step: int, slots: list[int], vectors: list[torch.Tensor], batches: list[SlotBatch],
                       quarantine: Iterable[int]) -> list[int]:
        """The shards to blame for this worker's non-finite slots at `step`: an injected data
        fault's poisoned samples; else each sample of a non-finite slot is computed alone and
        the shards of those non-finite on their own are blamed, provided some sample of this
        worker's step is finite (when none is, the model, not the data, is at fault: nothing
        is blamed and the coordinator stops the run)."""
        bad = [k for k, v in enumerate(vectors) if not bool(torch.isfinite(v).all())]
        poisoned = {sh for k in bad for sh, p in zip(batches[k].shards, batches[k].poisoned) if p}
        if poisoned or not bad:
            return sorted(poisoned)
        blamed, finite_seen = set(), len(bad) < len(vectors)
        saved = {n: t.detach().clone() for n, t in self.buffers().items()} if self.discard_buffers else {}
        for k in bad:
            g = self.loader.sampler.indices(step, slots[k], quarantine)
            for i, shard in zip(g, batches[k].shards):
                self.model.zero_grad(set_to_none=True)
                batch = to_device(self.loader.collate([self.dataset[i]]), self.device)
                loss = self.spec.job.loss(self.model, batch, slot_generator(self.seed, step, slots[k], self.device))
                loss.backward()
                ok = bool(torch.isfinite(loss)) and all(p.grad is None or bool(torch.isfinite(p.grad).all())
                                                        for p in self.params)
                finite_seen |= ok
                if not ok:
                    blamed.add(shard)
                with torch.no_grad():
                    for n, t in self.buffers().items() if saved else ():
                        t.copy_(saved[n])
        self.model.zero_grad(set_to_none=True)
        return sorted(blamed) if finite_seen else []

    def apply(self, mean: torch.Tensor) -> None:
        """The reduced mean gradient (float32, loss last) becomes every parameter's gradient,
        then the optimizer steps (then the scheduler, then the job's after_step)."""
        for p, grad in zip(self.params, mean.to(self.device).split(self.sizes + (1,))):
            p.grad = grad.view_as(p) if grad.dtype == p.dtype else grad.view_as(p).to(p.dtype)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.spec.job.after_step is not None:
            self.spec.job.after_step(self.model, self.optimizer, self.extra)

    def first_moments(self) -> list[torch.Tensor] | None:
        """The optimizer's first moment of every parameter where it keeps one (`exp_avg`: the
        Adam family), for the reduction's a priori bounds; None otherwise (the reduction then
        agrees its exponents in a first round: the same result, one round more)."""
        out = []
        for p in self.params:
            st = self.optimizer.state.get(p)
            if not st or not torch.is_tensor(st.get("exp_avg")) or st["exp_avg"].shape != p.shape:
                return None
            out.append(st["exp_avg"])
        return out

    def weights_sha256(self) -> str:
        from runtime.train_state import weights_sha256
        return weights_sha256(self.model)
