"""The examples of the job API (examples/, issue 26) under `keel run`, as a user runs them (the
reference runs in this process, through the same runtime.api.run_scenario that `keel run`
calls): one fault of every class absorbed with 0 restarts ends bit-identical to the run with
the scenario's NaN shard alone (its quarantine changes the data, nothing else does); a whole-job
SIGKILL after a checkpoint, then `--resume`, ends bit-identical to the uninterrupted run (the
transformers example: its LR scheduler travels in the checkpoint and to the hot spare; the
ResNet: SGD's momentum buffers)."""
from __future__ import annotations

import json
import subprocess

import pytest

from runtime_helpers import REPO, keel, run_and_kill_after_checkpoint

pytestmark = pytest.mark.timeout(300)

LLAMA = REPO / "examples" / "tiny_llama" / "scenario.toml"
RESNET = REPO / "examples" / "resnet_groupnorm" / "scenario.toml"
CKPT = 8


def keel_run(*args: str) -> dict:
    out = subprocess.run(keel("run", *args, "--json"), capture_output=True, text=True, cwd=str(REPO), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def assert_absorbed_bit_identical(faulty: dict, clean: dict, classes: list[str]) -> None:
    assert faulty["restarts"] == 0 and clean["faults"] == []
    assert [f["class"] for f in faulty["faults"]] == classes
    assert all(f["action"] != "checkpoint_restart" for f in faulty["faults"])
    assert faulty["losses"] == clean["losses"] and len(clean["losses"]) == 24
    assert faulty["final_weights_sha256"] == clean["final_weights_sha256"]
    assert clean["losses"][-1] < clean["losses"][0]  # it trains


def assert_resumes_bit_identical(scenario, clean: dict, tmp_path) -> dict:
    """`keel run` SIGKILLed whole once checkpoint CKPT is written, then `--resume`: it goes on
    from CKPT and ends as `clean` (the uninterrupted run) did, loss for loss and bit for bit.
    The killed run's checkpoint's optimizer metadata, for what the job saved beside it."""
    first, second = tmp_path / "killed", tmp_path / "resumed"
    run_and_kill_after_checkpoint(keel("run", str(scenario), "--out", str(first)), first, CKPT, timeout=200)
    assert not (first / "summary.json").exists()
    resumed = keel_run(str(scenario), "--out", str(second), "--resume", str(first))
    assert resumed["start_step"] == CKPT and resumed["restarts"] == 0
    assert resumed["losses"] == clean["losses"][CKPT:]
    assert resumed["final_weights_sha256"] == clean["final_weights_sha256"]
    return json.loads((first / "checkpoints" / f"step-{CKPT:08d}" / "optimizer_state.json").read_text())


def reference_run(scenario, out, data_faults: bool = False) -> dict:
    """The uninterrupted `--no-faults` run the others are compared with: what `keel run
    --no-faults` runs, in this process (runtime.api.run_scenario; no interpreter to start, and
    the fork server stays warm), so that only the runs under test pay a `keel run` each.
    `data_faults`: the scenario's faults on data shards kept (a poisoned shard is quarantined
    and its samples resampled: the trajectory then is that run's, not the fault-free one's)."""
    import dataclasses
    from keel import fault_classes
    from keel.scenario import load
    from runtime.api import run_scenario
    sc = load(scenario)
    if not data_faults:
        return run_scenario(sc, out, no_faults=True, progress=False)
    kept = tuple(e for e in sc.faults.schedule if fault_classes.REGISTRY[e.class_].shard_target)
    return run_scenario(dataclasses.replace(sc, faults=dataclasses.replace(sc.faults, schedule=kept)), out,
                        progress=False)


@pytest.fixture(scope="module")
def llama_nan_only(tmp_path_factory):
    """The transformers example with its NaN shard alone: the trajectory its faulty runs keep."""
    pytest.importorskip("transformers")
    return reference_run(LLAMA, tmp_path_factory.mktemp("llama") / "nan-only", data_faults=True)


@pytest.fixture(scope="module")
def resnet_nan_only(tmp_path_factory):
    return reference_run(RESNET, tmp_path_factory.mktemp("resnet") / "nan-only", data_faults=True)


def assert_every_class_absorbed(scenario, nan_only: dict, tmp_path) -> dict:
    """One scheduled fault of every class in one `keel run`, 0 restarts. The NaN shard aside
    (its quarantine changes the data from then on, as for the built-in job), the run ends bit
    for bit as `nan_only`, the run with the NaN shard alone."""
    from keel import fault_classes
    faulty = keel_run(str(scenario), "--out", str(tmp_path / "faulty"))
    classes = [f["class"] for f in faulty["faults"]]
    assert sorted(classes) == sorted(fault_classes.REGISTRY)
    assert [f["class"] for f in nan_only["faults"]] == [c for c in classes if fault_classes.REGISTRY[c].shard_target]
    assert nan_only["quarantine"] == faulty["quarantine"] != []
    assert_absorbed_bit_identical(faulty, dict(nan_only, faults=[]), classes)
    return faulty


def test_transformers_example_absorbs_a_fault_of_every_class_bit_identical(tmp_path, llama_nan_only):
    faulty = assert_every_class_absorbed(LLAMA, llama_nan_only, tmp_path)
    # the summary names the job (the dashboard's Runs page shows it): entry, config, parameters
    assert faulty["job"] == {"entry": "job.py:job", "config": llama_nan_only["job"]["config"], "params": 51_360}
    assert faulty["job"]["config"]["hidden_size"] == 32


def test_transformers_example_resumes_bit_identical_after_a_whole_job_kill(tmp_path, llama_nan_only):
    meta = assert_resumes_bit_identical(LLAMA, llama_nan_only, tmp_path)  # its NaN shard strikes after CKPT
    assert set(meta["extra"]) == {"scheduler"}  # the job's LambdaLR, saved with the optimizer


def test_plain_pytorch_example_absorbs_a_fault_of_every_class_bit_identical(tmp_path, resnet_nan_only):
    assert_every_class_absorbed(RESNET, resnet_nan_only, tmp_path)


def test_plain_pytorch_example_resumes_bit_identical_after_a_whole_job_kill(tmp_path, resnet_nan_only):
    meta = assert_resumes_bit_identical(RESNET, resnet_nan_only, tmp_path)
    assert meta["kind"] == "SGD" and not meta.get("extra")  # SGD's momentum buffers alone: no scheduler, no state


def test_profile_of_the_transformers_example(tmp_path, capsys):
    """`keel profile`: the parameter count is the model's own (transformers' count), the wire
    bytes are the reduction's buffers (one exponent byte per block of 32 of every tensor, the
    loss's and the non-finite flag; then int32 per element and the loss), and --write puts
    the measurements into a scenario that loads."""
    pytest.importorskip("transformers")
    import math

    from keel import wire
    from keel.cli import main as keel_main
    from keel.scenario import load
    from runtime.job_run import load_spec
    sc = load(LLAMA)
    spec = load_spec(sc)
    model = spec.job.model(0, spec.config)
    out = tmp_path / "profiled.toml"
    capsys.readouterr()
    assert keel_main(["profile", str(LLAMA), "--steps", "2", "--write", str(out), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)  # what it measured (--json: one object on stdout)
    assert measured["params"]["value"] == model.num_parameters() == 51_360
    blocks = sum(math.ceil(p.numel() / 32) for p in model.parameters())
    assert measured["wire_rounds"]["value"] == [["max", blocks + 2, blocks + 2], ["sum", 51_361, 4 * 51_361]]
    assert measured["wire_bytes"]["value"] == blocks + 2 + 4 * 51_361
    assert measured["wire_bytes"]["value"] == sum(n * b for _, n, b in wire.rounds(51_360, "block32", "float32", 4, blocks + 1))
    profiled = load(out)
    assert profiled.workload.params == 51_360 and profiled.job.config == sc.job.config
    assert load_spec(profiled).name.endswith("examples/tiny_llama/job.py:job")  # found from the written file
    assert profiled.checkpoint.weights_bytes > 4 * 51_360 and profiled.workload.step_compute_s > 0
