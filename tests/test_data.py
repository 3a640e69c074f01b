"""The versioned dataset and the deterministic loader (real files, real subprocesses)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, keel_cmd
from keel.errors import InputError
from runtime.data import Dataset, Loader, ensure_dataset, shard_name

torch.set_num_threads(1)
CONTEXT, MICRO_BATCH, SEED = 64, 4, 7


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Dataset:
    return ensure_dataset(tmp_path_factory.mktemp("data") / "ds", shards=16)


def batch_digest(b) -> str:
    h = hashlib.sha256()
    for t in (b.x, b.y):
        h.update(t.numpy().tobytes())
    h.update(repr(b.shards).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the dataset

def test_build_is_deterministic_and_versioned(dataset, tmp_path):
    again = ensure_dataset(tmp_path / "again", shards=16)
    assert again.built and not ensure_dataset(tmp_path / "again", shards=16).built
    assert again.version == dataset.version
    assert (again.root / "index.json").read_bytes() == (dataset.root / "index.json").read_bytes()
    index = json.loads((dataset.root / "index.json").read_text())
    assert len(index["shards"]) == 16
    for entry in index["shards"]:
        raw = (dataset.root / entry["file"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
        assert entry["samples"] == (len(raw) - 1) // 64 > 0
    assert dataset.version == hashlib.sha256(
        json.dumps(index, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert b"# file: " in dataset.data[0].tobytes()  # real text: the stdlib's own source
    other = ensure_dataset(tmp_path / "eight", shards=8)
    assert other.version != dataset.version


@pytest.mark.timeout(60)
def test_concurrent_builders_are_safe(tmp_path):
    root = tmp_path / "shared"
    code = "import sys; from runtime.data import ensure_dataset; print(ensure_dataset(sys.argv[1], 16).version)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    versions = {p.communicate(timeout=50)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(versions) == 1 and len(next(iter(versions))) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]  # no temp dir left behind


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_tampered_shard_is_refused_naming_it(dataset, tmp_path, damage):
    root = tmp_path / "ds"
    shutil.copytree(dataset.root, root)
    shard = root / shard_name(3)
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[1000] ^= 0x01
        shard.write_bytes(bytes(raw))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1])
    else:
        shard.unlink()
    for opener in (Dataset.open, lambda r: ensure_dataset(r, 16)):
        with pytest.raises(InputError, match=shard_name(3)):
            opener(root)


def test_missing_index_and_wrong_shard_count(dataset, tmp_path):
    with pytest.raises(InputError, match="index.json"):
        Dataset.open(tmp_path)
    with pytest.raises(InputError, match="16 shards"):
        ensure_dataset(dataset.root, shards=8)


@pytest.mark.timeout(60)
def test_cli_prepare_json(tmp_path):
    out = tmp_path / "prepared"
    r = subprocess.run(keel_cmd("data", "prepare", "--out", str(out), "--shards", "4", "--json"),
                       cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["shards"] == 4 and summary["built"] is True
    assert "shards" in r.stderr  # the progress bar goes to stderr
    assert summary["version"] == Dataset.open(out).version
    r = subprocess.run(keel_cmd("data", "prepare", "--shards", "0"), cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "--shards" in r.stderr


# ----------------------------------------------------------------------------- the loader

def test_batch_shapes_and_next_byte_targets(dataset):
    b = Loader(dataset, SEED, CONTEXT, MICRO_BATCH).batch(3, 1)
    assert b.x.shape == b.y.shape == (MICRO_BATCH, CONTEXT) and b.x.dtype == b.y.dtype == torch.int64
    assert torch.equal(b.x[:, 1:], b.y[:, :-1])
    assert b.w.dtype == torch.float32 and torch.equal(b.w, torch.ones(MICRO_BATCH))
    assert len(b.shards) == MICRO_BATCH and all(0 <= s < 16 for s in b.shards)
    for row, s in zip(b.x, b.shards):  # each sample lies inside its shard
        assert bytes(row.tolist()) in dataset.data[s].tobytes()


def test_order_depends_on_seed_step_slot(dataset):
    a = Loader(dataset, SEED, CONTEXT, MICRO_BATCH)
    digests = {batch_digest(a.batch(step, slot)) for step in range(10) for slot in range(4)}
    assert len(digests) == 40
    assert batch_digest(Loader(dataset, SEED + 1, CONTEXT, MICRO_BATCH).batch(0, 0)) != batch_digest(a.batch(0, 0))


@pytest.mark.timeout(60)
def test_same_samples_across_processes_and_worker_counts(dataset):
    steps, slots = range(0, 50, 7), range(8)
    code = ("import sys, json, hashlib; from runtime.data import Dataset, Loader\n"
            "ds = Dataset.open(sys.argv[1]); L = Loader(ds, %d, %d, %d)\n"
            "print(json.dumps({f'{s}/{k}': hashlib.sha256(L.batch(s, k).x.numpy().tobytes() + L.batch(s, k).y.numpy().tobytes()"
            " + repr(L.batch(s, k).shards).encode()).hexdigest() for s in %r for k in %r}))"
            % (SEED, CONTEXT, MICRO_BATCH, list(steps), list(slots)))
    r = subprocess.run([sys.executable, "-c", code, str(dataset.root)], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    other_process = json.loads(r.stdout)
    for workers in (1, 2, 4):  # each worker its own loader, slots dealt round-robin
        loaders = [Loader(Dataset.open(dataset.root), SEED, CONTEXT, MICRO_BATCH) for _ in range(workers)]
        seen = {f"{s}/{k}": batch_digest(loaders[k % workers].batch(s, k)) for s in steps for k in slots}
        assert seen == other_process


def test_resume_is_o1_from_state(dataset):
    a = Loader(dataset, SEED, CONTEXT, MICRO_BATCH)
    state = json.loads(json.dumps(a.state(1_000_000, {2, 5})))
    assert state["step"] == 1_000_000 and state["quarantine"] == [2, 5] and state["version"] == dataset.version
    b = Loader.from_state(dataset, state, CONTEXT, MICRO_BATCH)
    q = frozenset(state["quarantine"])
    assert batch_digest(b.batch(state["step"], 3, q)) == batch_digest(a.batch(1_000_000, 3, q))


def test_from_state_refuses_another_dataset_or_shape(dataset, tmp_path):
    state = Loader(dataset, SEED, CONTEXT, MICRO_BATCH).state(10)
    other = ensure_dataset(tmp_path / "eight", shards=8)
    with pytest.raises(InputError, match="dataset version"):
        Loader.from_state(other, state, CONTEXT, MICRO_BATCH)
    with pytest.raises(InputError, match="context"):
        Loader.from_state(dataset, state, 32, MICRO_BATCH)


def test_quarantine_replaces_exactly_the_shards_samples(dataset):
    L = Loader(dataset, SEED, CONTEXT, MICRO_BATCH)
    bad = frozenset({3, 11})
    replaced = 0
    for step in range(200):
        plain, q1, q2 = L.batch(step, 2), L.batch(step, 2, bad), L.batch(step, 2, bad)
        assert batch_digest(q1) == batch_digest(q2)  # deterministic
        assert not set(q1.shards) & bad
        for i, s in enumerate(plain.shards):
            if s in bad:
                replaced += 1
            else:  # untouched samples stay where they were
                assert torch.equal(plain.x[i], q1.x[i]) and q1.shards[i] == s
    assert replaced > 0
    with pytest.raises(InputError, match="quarantined"):
        L.batch(0, 0, frozenset(range(16)))


def test_poisoned_shard_gives_nan_weights(dataset):
    L = Loader(dataset, SEED, CONTEXT, MICRO_BATCH)
    step = next(s for s in range(100) if len(set(L.batch(s, 0).shards)) > 1)
    b = L.batch(step, 0)
    poisoned = frozenset({b.shards[0]})
    p = L.batch(step, 0, poisoned=poisoned)
    assert torch.equal(p.x, b.x)
    assert [bool(torch.isnan(v)) for v in p.w] == [s in poisoned for s in b.shards]


def test_the_dataset_lives_in_the_checkout_or_the_user_cache_never_in_site_packages(tmp_path, monkeypatch):
    from runtime import data
    monkeypatch.delenv("KEEL_DATA_DIR", raising=False)
    assert data.default_root(16) == data.REPO_ROOT / "data" / "stdlib-16"  # this checkout
    installed = tmp_path / "site-packages"  # an installed copy: no pyproject.toml beside it
    installed.mkdir()
    monkeypatch.setattr(data, "REPO_ROOT", installed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert data.default_root(8) == tmp_path / "cache" / "keel" / "data" / "stdlib-8"
    monkeypatch.setenv("KEEL_DATA_DIR", str(tmp_path / "mine"))
    assert data.default_root(8) == tmp_path / "mine" / "stdlib-8"
