"""The job API (runtime/job.py, issue 26): a scenario's `[job]`, the built-in GPT through it,
the token-file dataset, and the contract: one test per rule, each a `keel run` that exits 2
with one line naming the job and the rule, and writes nothing a `--resume` could take for
progress (the run directory is not even created)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from keel.cli import main as keel_main
from keel.errors import InputError
from keel.scenario import loads
from runtime_helpers import scenario_text

pytestmark = pytest.mark.timeout(120)

JOBS = Path(__file__).resolve().parent / "job_contract_jobs.py"


def job_scenario(factory: str, config: str = "") -> str:
    return scenario_text(steps=4, slots=4) + f'\n[job]\nentry = "{JOBS}:{factory}"\n' + (
        f"[job.config]\n{config}\n" if config else "")


def run_job(tmp_path: Path, factory: str, capsys) -> tuple[int, str]:
    path = tmp_path / f"{factory}.toml"
    path.write_text(job_scenario(factory))
    out = tmp_path / "run"
    rc = keel_main(["run", str(path), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert not out.exists(), f"{out} was created"
    return rc, err


RULES = [
    ("missing", "the entry must import", "has no attribute 'missing'"),
    ("factory_raises", "the factory must return a Job", "RuntimeError: no GPU quota left in this project"),
    ("not_a_job", "the factory must return a Job", "it returned dict"),
    ("model_raises", "the model builder must succeed", "ValueError: hidden_size must be divisible by heads"),
    ("iterable_dataset", "the dataset must be map-style", "cannot re-split by slot"),
    ("stateful_loader", "the dataset must be map-style", "it is a DataLoader"),
    ("too_small", "every shard must hold a sample", "3 samples are fewer than data.shards (16)"),
    ("integer_parameter", "parameters must be floating tensors", "parameter counter is torch.int64"),
    ("batch_of_strings", "a batch must be a tensor or a dict/tuple of tensors", "a list of str"),
    ("vector_loss", "the loss must be a scalar tensor", "of shape (2,)"),
    ("batchnorm", "the forward pass must not write buffers", "buffer 1.running_mean changed"),
    ("unseeded_model", "the weights must be a function of (seed, config)", "two builds with the same seed differ"),
    ("loss_raises", "the loss must compute", "it raised ValueError: no input_ids in the batch second line of the message"),
    ("global_rng_loss", "the per-slot computation must be bitwise reproducible", "slot 0 of step 0 computed twice"),
]


@pytest.mark.parametrize("factory,rule,detail", RULES, ids=[r[0] for r in RULES])
def test_a_job_that_breaks_a_rule_exits_2_with_one_line(tmp_path, capsys, factory, rule, detail):
    rc, err = run_job(tmp_path, factory, capsys)
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"keel: job {JOBS}:{factory}: {rule}: "), err
    assert detail in err, err


def test_a_missing_entry_file_is_named(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(scenario_text(steps=4) + '\n[job]\nentry = "nowhere/job.py:job"\n')
    assert keel_main(["run", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "job nowhere/job.py:job: the entry must import: FileNotFoundError: no file " + str(tmp_path / "nowhere") in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("factory", ["good", "batchnorm_discarded", "generator_loss"])
def test_jobs_that_keep_the_contract_pass_it(factory):
    from runtime.job_check import check_job
    assert check_job(loads(job_scenario(factory), "<test>")) == f"{JOBS}:{factory}"


def test_discarded_buffers_stay_as_built():
    from runtime.job_run import BoundJob, load_spec
    sc = loads(job_scenario("batchnorm_discarded"), "<test>")
    bound = BoundJob(load_spec(sc), sc)
    before = {n: t.clone() for n, t in bound.buffers().items()}
    bound.slot_vector(0, 1)
    assert all(torch.equal(before[n], t) for n, t in bound.buffers().items())


# ----------------------------------------------------------------------------- the scenario's [job]

def test_job_table_enters_the_config_hash_and_only_when_present():
    base = loads(scenario_text(), "<t>")
    assert "job" not in base.to_dict()  # a scenario without [job] hashes as before the table existed
    a = loads(job_scenario("good", "samples = 256"), "<t>")
    b = loads(job_scenario("good", "samples = 128"), "<t>")
    c = loads(job_scenario("batchnorm"), "<t>")
    assert len({base.config_hash(), a.config_hash(), b.config_hash(), c.config_hash()}) == 4
    assert a.job.config == {"samples": 256}
    from keel.scenario import dumps
    assert loads(dumps(a), "<t>").config_hash() == a.config_hash()


@pytest.mark.parametrize("entry", ["job.py", "job.py:", ":job", "job.py:2x"])
def test_a_malformed_entry_is_refused_by_the_scenario(entry):
    with pytest.raises(InputError, match="key 'job.entry': expected 'package.module:factory'"):
        loads(scenario_text() + f'\n[job]\nentry = "{entry}"\n', "<t>")


def test_job_config_must_be_a_table():
    with pytest.raises(InputError, match="key 'job.config': expected a table"):
        loads(scenario_text() + '\n[job]\nentry = "m:f"\nconfig = 3\n', "<t>")


# ----------------------------------------------------------------------------- the built-in job

def test_the_builtin_gpt_is_a_job_whose_samples_are_the_loaders():
    """Sample for sample, the built-in job's batches are runtime.data.Loader's."""
    from runtime.data import Loader
    from runtime.job_run import BoundJob, load_spec
    sc = loads(scenario_text(), "<t>")
    bound = BoundJob(load_spec(sc), sc)
    ds = bound.dataset.loader.dataset
    ref = Loader(ds, sc.run.seed, sc.model.context, sc.workload.micro_batch)
    for step, slot in [(0, 0), (7, 3)]:
        a, b = bound.loader.batch(step, slot, {2}), ref.batch(step, slot, {2})
        assert torch.equal(a.data[0], b.x) and torch.equal(a.data[1], b.y) and a.shards == b.shards
    assert bound.loader.state(5, {2}) == {**ref.state(5, {2}), "job_api": 1}


def test_no_builder_of_the_builtin_job_is_called_outside_its_module():
    repo = Path(__file__).resolve().parents[1]
    allowed = {"runtime/job_gpt.py", "runtime/model.py", "runtime/data.py"}
    for path in sorted((repo / "runtime").rglob("*.py")) + sorted((repo / "keel").rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        if rel in allowed:
            continue
        text = path.read_text()
        for name in ("build_model", "build_optimizer", "ensure_dataset", "slot_loss"):
            assert not re.search(rf"(?<![\w.])(?<!def ){name}\(", text), f"{rel} calls {name}"


# ----------------------------------------------------------------------------- the token file

def test_token_file_samples_versions_and_dtypes(tmp_path):
    from runtime.job import TokenFile, write_token_file
    ids = np.arange(1000) % 700
    p16 = write_token_file(tmp_path / "t16.bin", ids, "uint16")
    p32 = write_token_file(tmp_path / "t32.bin", ids + 70_000, "uint32")
    a = TokenFile(p16, context=10)
    assert len(a) == 99 and p16.stat().st_size == 2000
    s = a[3]
    assert s["input_ids"].tolist() == list(range(30, 40)) and s["labels"].tolist() == list(range(31, 41))
    assert s["input_ids"].dtype == torch.int64
    b = TokenFile(p32, context=10, dtype="uint32")
    assert b[0]["input_ids"][0].item() == 70_000
    assert a.version != b.version and a.version == TokenFile(p16, context=5).version
    with pytest.raises(IndexError):
        a[99]
    with pytest.raises(InputError, match="token dtype: expected one of uint16, uint32"):
        TokenFile(p16, context=10, dtype="int8")


def test_the_slot_generator_depends_on_seed_step_and_slot_only():
    from runtime.job import slot_generator
    draw = lambda *a: torch.rand(4, generator=slot_generator(*a)).tolist()  # noqa: E731
    assert draw(1, 2, 3) == draw(1, 2, 3)
    assert len({tuple(draw(*a)) for a in [(1, 2, 3), (2, 2, 3), (1, 3, 3), (1, 2, 4)]}) == 4


# ----------------------------------------------------------------------------- state: checkpoint, spare, version

class Counter:
    """A job's further state: tensors and JSON values, by key."""

    def __init__(self) -> None:
        self.seen, self.ema = 0, torch.zeros(3)

    def state_dict(self):
        return {"seen": self.seen, "ema": self.ema.clone(), "nested": {"pair": (1, 2.5)}}

    def load_state_dict(self, sd):
        self.seen, self.ema = sd["seen"], sd["ema"].clone()
        assert sd["nested"]["pair"] == (1, 2.5)


def _trained(steps: int = 3):
    from runtime.job_run import BoundJob, load_spec
    sc = loads(job_scenario("good"), "<test>")
    bound = BoundJob(load_spec(sc), sc)
    for step in range(steps):
        bound.apply(torch.stack([bound.slot_vector(step, s)[0] for s in range(4)]).mean(0))
    return sc, bound


def test_any_optimizers_state_and_the_jobs_state_go_through_a_checkpoint(tmp_path):
    from runtime import checkpoint as ck
    from runtime.job_run import BoundJob, load_spec
    sc, bound = _trained()
    counter = Counter()
    counter.seen, counter.ema = 7, torch.tensor([1.0, -2.0, 0.5])
    path = ck.save_checkpoint(tmp_path, step=3, model=bound.model, optimizer=bound.optimizer, rng=ck.capture_rng(),
                              data_state=bound.loader.state(3), config_hash="a" * 64, config={}, topology={},
                              extra={"counter": counter})
    fresh = BoundJob(load_spec(sc), sc)
    restored = Counter()
    ck.load_checkpoint(path).apply_to(fresh.model, fresh.optimizer, {"counter": restored})
    assert fresh.weights_sha256() == bound.weights_sha256()
    assert restored.seen == 7 and torch.equal(restored.ema, counter.ema)
    for p, q in zip(bound.params, fresh.params):  # SGD's momentum: no AdamW field assumed
        assert torch.equal(bound.optimizer.state[p]["momentum_buffer"], fresh.optimizer.state[q]["momentum_buffer"])
    with pytest.raises(ck.CheckpointError, match=r"holds the job state \['counter'\], the job registers \[\]"):
        ck.load_checkpoint(path).apply_to(fresh.model, fresh.optimizer, {})


def test_the_state_sent_to_a_spare_is_bit_exact_for_any_optimizer():
    from runtime.job_run import BoundJob, load_spec
    from runtime.worker_state import load_state_blob, state_blob
    sc, bound = _trained()
    spare = BoundJob(load_spec(sc), sc)
    load_state_blob(state_blob(bound.optimizer, bound.model, {}), spare.optimizer, {})
    for p, q in zip(bound.params, spare.params):
        q.data.copy_(p.data)
    bound.apply(torch.stack([bound.slot_vector(3, s)[0] for s in range(4)]).mean(0))
    spare.apply(torch.stack([spare.slot_vector(3, s)[0] for s in range(4)]).mean(0))
    assert spare.weights_sha256() == bound.weights_sha256()


def test_first_moments_only_where_the_optimizer_keeps_them():
    """The reduction's a priori bounds come from exp_avg (Adam family) and are None otherwise."""
    sc, sgd = _trained(1)
    assert sgd.first_moments() is None
    from runtime.job_run import BoundJob, load_spec
    gpt = BoundJob(load_spec(loads(scenario_text(), "<t>")), loads(scenario_text(), "<t>"))
    assert gpt.first_moments() is None  # before the first step
    gpt.apply(gpt.slot_vector(0, 0)[0])
    assert [m.shape for m in gpt.first_moments()] == [p.shape for p in gpt.params]


def test_a_jobs_ema_and_scheduler_are_updated_checkpointed_and_sent_to_a_spare(tmp_path):
    from runtime import checkpoint as ck
    from runtime.job_run import BoundJob, load_spec
    from runtime.train_state import weights_sha256
    from runtime.worker_state import load_state_blob, state_blob
    sc = loads(job_scenario("with_ema"), "<test>")
    bound = BoundJob(load_spec(sc), sc)
    assert set(bound.extra) == {"ema", "scheduler"}
    for step in range(3):
        bound.apply(torch.stack([bound.slot_vector(step, s)[0] for s in range(4)]).mean(0))
    ema = bound.extra["ema"]
    assert ema.steps == 3 and bound.scheduler.last_epoch == 3 and bound.optimizer.param_groups[0]["lr"] == 0.05
    path = ck.save_checkpoint(tmp_path, step=3, model=bound.model, optimizer=bound.optimizer, rng=ck.capture_rng(),
                              data_state=bound.loader.state(3), config_hash="a" * 64, config={}, topology={},
                              extra=bound.extra)
    resumed, spare = BoundJob(load_spec(sc), sc), BoundJob(load_spec(sc), sc)
    ck.load_checkpoint(path).apply_to(resumed.model, resumed.optimizer, resumed.extra)
    load_state_blob(state_blob(bound.optimizer, bound.model, bound.extra), spare.optimizer, spare.extra)
    for other in (resumed, spare):
        for p, q in zip(bound.params, other.params):
            q.data.copy_(p.data)
        assert other.extra["ema"].steps == 3 and weights_sha256(other.extra["ema"].weights) == weights_sha256(ema.weights)
        assert other.scheduler.last_epoch == 3
    for job in (bound, resumed, spare):  # the next steps agree, LR decay and EMA included
        for step in (3, 4):
            job.apply(torch.stack([job.slot_vector(step, s)[0] for s in range(4)]).mean(0))
    assert bound.weights_sha256() == resumed.weights_sha256() == spare.weights_sha256()
    assert len({weights_sha256(j.extra["ema"].weights) for j in (bound, resumed, spare)}) == 1
    assert bound.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"] == 0.025


def test_a_checkpoint_of_another_job_api_version_is_refused(tmp_path):
    from runtime import checkpoint as ck
    sc, bound = _trained(1)
    path = ck.save_checkpoint(tmp_path, step=1, model=bound.model, optimizer=bound.optimizer, rng=ck.capture_rng(),
                              data_state={**bound.loader.state(1), "job_api": 2}, config_hash="a" * 64, config={},
                              topology={})
    with pytest.raises(ck.CheckpointError, match="written under job API version 2, this keel speaks 1"):
        ck.load_checkpoint(path)


def test_the_docs_twenty_line_example_keeps_the_contract(tmp_path):
    """docs/job-api.md's example, as printed there, passes the contract check."""
    from runtime.job_check import check_job
    doc = (Path(__file__).resolve().parents[1] / "docs" / "job-api.md").read_text()
    code = doc.split("## A twenty-line example")[1].split("```python\n")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 22
    (tmp_path / "mlp.py").write_text(code)
    (tmp_path / "s.toml").write_text(scenario_text(steps=4) + '\n[job]\nentry = "mlp.py:job"\n[job.config]\nwidth = 16\n')
    from keel.scenario import load
    assert check_job(load(tmp_path / "s.toml")) == "mlp.py:job"


# ----------------------------------------------------------------------------- a non-finite value, traced

def test_a_non_finite_slot_is_traced_to_its_samples_shard():
    from runtime.job_run import BoundJob, load_spec
    sc = loads(job_scenario("bad_shard", "shards = 16\nbad_shard = 5"), "<test>")
    bound = BoundJob(load_spec(sc), sc)
    step, found = 0, None
    for step in range(40):  # a step whose slots 0-3 draw a sample of shard 5
        out = [bound.slot_vector(step, s) for s in range(4)]
        if any(5 in b.shards for _, b in out):
            found = out
            break
    vectors, batches = [v for v, _ in found], [b for _, b in found]
    assert [bool(torch.isfinite(v).all()) for v in vectors] == [5 not in b.shards for b in batches]
    assert bound.suspect_shards(step, [0, 1, 2, 3], vectors, batches, frozenset()) == [5]


def test_a_diverged_model_is_not_blamed_on_the_data():
    from runtime.job_run import BoundJob, load_spec
    sc = loads(job_scenario("diverging"), "<test>")
    bound = BoundJob(load_spec(sc), sc)
    out = [bound.slot_vector(0, s) for s in range(2)]
    assert bound.suspect_shards(0, [0, 1], [v for v, _ in out], [b for _, b in out], frozenset()) == []


def test_a_run_quarantines_a_shard_of_bad_data_and_completes(tmp_path):
    from keel.events import read_events
    from runtime.api import run_scenario
    sc = loads(job_scenario("bad_shard", "shards = 16\nbad_shard = 5").replace("steps = 4", "steps = 12"), "<test>")
    summary = run_scenario(sc, tmp_path / "run", progress=False)
    quarantines = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e.kind == "quarantine"]
    assert [q.detail["shards"] for q in quarantines] == [[5]]
    assert summary["steps"] == 12 and summary["restarts"] == 0
