"""The job contract, checked in the launching process before anything is written or started
(runtime/api.check_runnable): each violation a JobError (exit 2) of one line naming the job,
the rule and what to do. runtime/job_run.py checks the structural rules as it builds (the
entry, each builder, a map-style dataset, floating parameters); this module runs the job's
first slot to check the rest:

- the weights are a function of (seed, config): two builds hash the same;
- a batch is a tensor, or a dict, tuple or list of tensors;
- the loss is a finite-dtype scalar tensor with a gradient;
- the forward pass writes no buffer (BatchNorm's running statistics), unless the job declares
  `mutable_buffers = "discard"`;
- the per-slot computation is bitwise reproducible: slot 0 of step 0 computed twice, the same bits.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from runtime.job_run import BoundJob, JobError, JobSpec, load_spec


def is_batch(batch: Any) -> bool:
    if torch.is_tensor(batch):
        return True
    if isinstance(batch, dict):
        return bool(batch) and all(torch.is_tensor(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return bool(batch) and all(torch.is_tensor(v) for v in batch)
    return False


def describe(batch: Any) -> str:
    if isinstance(batch, dict):
        return "a dict of " + ", ".join(f"{k}: {type(v).__name__}" for k, v in list(batch.items())[:4])
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of " + ", ".join(type(v).__name__ for v in batch[:4])
    return f"a {type(batch).__name__}"


def check_bound(bound: BoundJob) -> None:
    """The rules that need the job's first slot (the module docstring lists them)."""
    spec = bound.spec
    name = spec.name
    from runtime.job_run import built
    from runtime.train_state import weights_sha256
    again = built(spec, "model", spec.job.model, bound.seed, spec.config)
    if weights_sha256(again) != weights_sha256(bound.model):
        raise JobError(name, "the weights must be a function of (seed, config)", "two builds with the same seed "
                       "differ; draw the initial weights from a torch.Generator seeded with `seed`, not the global RNG")
    del again
    b = built(spec, "", lambda: bound.loader.batch(0, 0), rule="the dataset's items and collate must give a batch")
    if not is_batch(b.data):
        raise JobError(name, "a batch must be a tensor or a dict/tuple of tensors", f"the collated batch is "
                       f"{describe(b.data)}; make the dataset's items tensors or give a collate that stacks them")
    before = {n: t.detach().clone() for n, t in bound.buffers().items()}
    loss, _ = built(spec, "", bound.slot_loss, 0, 0, rule="the loss must compute")
    if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point()):
        raise JobError(name, "the loss must be a scalar tensor", f"it returned {describe(loss)}"
                       f"{' of shape ' + str(tuple(loss.shape)) if torch.is_tensor(loss) else ''}; reduce it to one value")
    if not loss.requires_grad:
        raise JobError(name, "the loss must depend on the parameters", "it has no gradient; compute it from model(...)")
    loss.backward()
    bound.model.zero_grad(set_to_none=True)
    changed = [n for n, t in bound.buffers().items() if not torch.equal(before[n], t)]
    if changed and not bound.discard_buffers:
        raise JobError(name, "the forward pass must not write buffers", f"buffer {changed[0]} changed (running "
                       f"statistics such as BatchNorm's depend on which slots a worker holds); use GroupNorm or "
                       f"LayerNorm, or declare mutable_buffers='discard' to keep them as built")
    with torch.no_grad():  # back to the state the rest of the checks start from
        for n, t in bound.buffers().items():
            t.copy_(before[n])
    first = built(spec, "", lambda: bound.slot_vector(0, 0)[0], rule="the loss must compute")
    second = built(spec, "", lambda: bound.slot_vector(0, 0)[0], rule="the loss must compute")
    if not torch.equal(first.view(torch.int32), second.view(torch.int32)):
        differ = int((first.view(torch.int32) != second.view(torch.int32)).sum())
        raise JobError(name, "the per-slot computation must be bitwise reproducible", f"slot 0 of step 0 computed "
                       f"twice differs in {differ} of {first.numel()} values; take randomness only from the "
                       f"generator keel passes the loss, and avoid nondeterministic kernels "
                       f"(torch.use_deterministic_algorithms)")


@functools.lru_cache(maxsize=16)
def _checked(config_hash: str, source: str, data_root: str | None, scenario_json: str) -> str:
    from keel.scenario import from_dict
    import json
    scenario = from_dict(json.loads(scenario_json), source=source)
    spec = load_spec(scenario, data_root)
    with torch.random.fork_rng(devices=[]):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            check_bound(BoundJob(spec, scenario, "cpu"))
        finally:
            torch.set_num_threads(threads)
    return spec.name


def check_job(scenario, data_root: str | None = None) -> str:
    """JobError when the scenario's job breaks the contract; else its name. Once per
    configuration and process."""
    import json
    if not scenario.job.entry:
        from runtime.job_gpt import check_scenario
        check_scenario(scenario)
    return _checked(scenario.config_hash(), scenario.source, data_root, json.dumps(scenario.plain()))


__all__ = ["check_job", "check_bound", "JobError", "JobSpec"]
