"""`--resume --allow-config-change` with a model of another shape: found before the job
starts, by comparing the tensor shapes of the checkpoint it would resume from (its weights
file's safetensors header, nothing else read) with the scenario's job's model."""
from __future__ import annotations

from pathlib import Path

from keel.errors import InputError
from keel.scenario import Scenario


def checkpoint_shapes(path: Path) -> dict[str, list[int]]:
    """{tensor name: shape} of a checkpoint's weights."""
    from keel.ckpt_reader import MAX_HEADER
    with open(path / "weights.safetensors", "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        data = head + f.read(min(n, MAX_HEADER))
    tensors, _ = _header_only(data)
    try:
        return {name: list(t["shape"]) for name, t in tensors.items()}
    except (TypeError, KeyError) as e:
        raise ValueError("not a safetensors header") from e


def _header_only(data: bytes) -> tuple[dict, dict]:
    """The safetensors header of a file of which only the header was read."""
    import json
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if not isinstance(header, dict):
        raise ValueError("not a safetensors header")
    meta = header.pop("__metadata__", {})
    return header, meta


def model_shapes(scenario: Scenario) -> dict[str, list[int]]:
    """The scenario's job's model, built by its builder (runtime/job_run.py)."""
    import torch

    from runtime.job_run import built, load_spec
    spec = load_spec(scenario)
    with torch.random.fork_rng(devices=[]):
        model = built(spec, "model", spec.job.model, scenario.run.seed, spec.config)
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def first_mismatch(stored: dict[str, list[int]], wanted: dict[str, list[int]]) -> str | None:
    """The first tensor (in the model's order) whose shape differs, is missing, or is extra, in words."""
    for name, shape in wanted.items():
        if name not in stored:
            return f"tensor {name} {shape}: not in the checkpoint"
        if stored[name] != shape:
            return f"tensor {name}: the checkpoint's is {stored[name]}, the scenario's model's is {shape}"
    extra = [name for name in stored if name not in wanted]
    return f"tensor {extra[0]} {stored[extra[0]]}: in the checkpoint, not in the scenario's model" if extra else None


def check_resume_shapes(scenario: Scenario, resume: str | Path) -> None:
    """InputError naming the first mismatching tensor, before anything starts, when the
    checkpoint `--resume` would load does not fit the scenario's model."""
    from runtime.checkpoint_read import newest_in_run
    resume = Path(resume)
    latest = newest_in_run(resume)
    if latest is None:
        return  # the coordinator says why there is nothing to resume from
    try:
        stored = checkpoint_shapes(latest)
    except (OSError, ValueError):
        return  # a damaged checkpoint: the coordinator's reader refuses it with the reason
    why = first_mismatch(stored, model_shapes(scenario))
    if why is not None:
        raise InputError(f"--resume {resume}: {latest.name} does not fit the scenario's model ({why}); "
                         f"--allow-config-change resumes a changed configuration, not a model of another shape")
