"""The reference reader (keel/ckpt_reader.py): torch-free, written from the spec, and strict."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import REPO, keel_cmd
from keel import ckpt_reader
from test_checkpoint import TINY, save, train
from runtime.model import build_model, build_optimizer

torch.set_num_threads(1)
SEVEN = ["weights", "optimizer_state", "rng_state", "data_offset", "config_hash", "cluster_topology", "commit_sha"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reader") / "run"
    model = build_model(TINY, seed=2)
    opt = build_optimizer(model, TINY)
    for step in (5, 10):
        train(model, opt, 2, step)
        save(run, step, model, opt)
    return run


@pytest.fixture
def ckpt(run_dir, tmp_path) -> Path:
    shutil.copytree(run_dir / "step-00000010", tmp_path / "step-00000010")
    return tmp_path / "step-00000010"


def reseal(path: Path) -> None:
    """Rewrite the manifest's checksums and self-checksum as the spec defines them, as a forger
    (or a buggy writer) would: the checksums then pass and only the content checks remain."""
    mpath = path / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest.pop("manifest_sha256")
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    manifest["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    mpath.write_text(json.dumps(manifest, indent=1))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(keel_cmd("ckpt", *args), cwd=REPO, capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
def test_reader_imports_no_torch_and_no_runtime():
    code = "import sys, keel.ckpt_reader; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'runtime', 'numpy', 'safetensors')]; print(bad)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_safetensors_parser_agrees_with_the_library(ckpt):
    for name in ("weights.safetensors", "optimizer_state.safetensors", "rng_state.safetensors"):
        tensors, metadata = ckpt_reader.safetensors_header((ckpt / name).read_bytes())
        with safe_open(ckpt / name, framework="pt") as f:
            assert sorted(tensors) == sorted(f.keys())
            assert metadata == f.metadata()
            for key in f.keys():
                assert tensors[key]["shape"] == list(f.get_slice(key).get_shape())


@pytest.mark.timeout(60)
def test_verify_and_inspect_json(ckpt, run_dir):
    assert ckpt_reader.verify(ckpt) == []
    r = cli("verify", str(ckpt))
    assert r.returncode == 0 and "ok" in r.stdout
    r = cli("verify", str(run_dir), "--json")  # a run directory: every checkpoint in it
    assert r.returncode == 0 and [c["ok"] for c in json.loads(r.stdout)["checkpoints"]] == [True, True]
    r = cli("inspect", str(ckpt), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)  # one JSON object and nothing else on stdout
    assert info["ok"] and info["step"] == 10 and info["format_version"] == 1
    assert sorted(info["fields"]) == sorted(SEVEN)
    assert all(info["fields"][f]["bytes"] > 0 for f in SEVEN)
    model = build_model(TINY, 0)
    assert info["fields"]["weights"]["elements"] == sum(p.numel() for p in model.parameters())
    assert info["fields"]["weights"]["tensors"] == len(model.state_dict())
    assert info["fields"]["config_hash"]["value"] == "c" * 64
    assert "torch_cpu" in info["fields"]["rng_state"]["generators"]
    assert info["fields"]["data_offset"]["value"]["step"] == 10
    assert info["fields"]["cluster_topology"]["value"]["members"] == ["r0/0", "r0/1"]
    r = cli("inspect", str(ckpt))
    assert r.returncode == 0 and all(f in r.stdout for f in SEVEN)


@pytest.mark.timeout(60)
def test_bad_paths(tmp_path):
    r = cli("verify", str(tmp_path / "nope"))
    assert r.returncode == 2 and "nope" in r.stderr
    incomplete = tmp_path / ".tmp-step-00000001-1-ab"
    incomplete.mkdir()
    (incomplete / "weights.safetensors").write_bytes(b"\0" * 16)
    r = cli("verify", str(incomplete))
    assert r.returncode == 1 and "manifest.json" in r.stderr


def test_content_checks_behind_valid_checksums(ckpt):
    assert ckpt_reader.verify(ckpt) == []
    ctx = json.loads((ckpt / "context.json").read_text())
    ctx["step"] = 11
    (ckpt / "context.json").write_text(json.dumps(ctx))
    reseal(ckpt)
    assert any("context.json" in p and "step" in p for p in ckpt_reader.verify(ckpt))

    ctx["step"], ctx["commit_sha"] = 10, "abc"
    (ckpt / "context.json").write_text(json.dumps(ctx))
    reseal(ckpt)
    assert any("commit_sha" in p for p in ckpt_reader.verify(ckpt))

    ctx["commit_sha"] = "unknown"
    (ckpt / "context.json").write_text(json.dumps(ctx))
    reseal(ckpt)
    assert ckpt_reader.verify(ckpt) == []

    raw = bytearray((ckpt / "weights.safetensors").read_bytes())
    (ckpt / "weights.safetensors").write_bytes(bytes(raw[:-4]))  # tensors no longer fit the data
    reseal(ckpt)
    assert any("weights.safetensors" in p and "safetensors" in p for p in ckpt_reader.verify(ckpt))


def test_manifest_must_name_the_seven_fields_and_a_known_version(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["fields"]["commit_sha"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    reseal(ckpt)
    assert any("seven fields" in p for p in ckpt_reader.verify(ckpt))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["format_version"] = 2
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    reseal(ckpt)
    assert any("format version 2" in p for p in ckpt_reader.verify(ckpt))
