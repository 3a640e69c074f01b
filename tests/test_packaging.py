"""The distribution as a user installs it: a wheel built from this checkout, installed in a
fresh virtual environment, runs `keel` from another directory with the packaged scenarios.

Offline: the wheel is built without build isolation (setuptools comes with the dev extra) and
installed without dependencies; the fresh environment borrows this one's packages (torch,
simpy, ...) through a .pth line, which adds the folder but runs none of its .pth files, so
this checkout's editable install stays invisible there.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "keel", "twin", "runtime", "planner", "app", "scenarios")


def _python_folders() -> set[str]:
    """Every folder of the checkout's packages that holds Python files, as a package name."""
    found = set()
    for top in ("keel", "twin", "runtime", "planner", "app"):
        for py in (REPO / top).rglob("*.py"):
            if "__pycache__" not in py.parts:
                found.add(".".join(py.parent.relative_to(REPO).parts))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:  # a copy: the build's own folders stay out of the working tree
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "--no-index", "--quiet", "--wheel-dir", str(out), str(src)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns its `keel` command."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(purelib, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                           "--no-index", "--quiet", str(wheel)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keel = venv / "bin" / "keel"
    assert keel.is_file()
    return keel


def _run(keel: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KEEL_RUNS", "VIRTUAL_ENV")}
    return subprocess.run([str(keel), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_wheel_holds_every_package_the_scenarios_and_the_licence(wheel):
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "keel-twin" and meta["scripts"] == {"keel": "keel.cli:main"}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    packages = {".".join(n.split("/")[:-1]) for n in names if n.endswith(".py")}
    missing = _python_folders() - packages
    assert not missing, f"pyproject.toml's [tool.setuptools] packages leaves out {sorted(missing)}"
    scenarios = sorted(p.name for p in (REPO / "scenarios").glob("*.toml"))
    assert {f"keel/scenarios/{s}" for s in scenarios} <= names
    assert not any(n.startswith("scenarios/") for n in names)  # no top-level package of that name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "Name: keel-twin" in metadata and "License-Expression: MIT" in metadata
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata
    assert "keel = keel.cli:main" in entry_points


def test_installed_keel_runs_the_packaged_scenarios_from_any_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    version = _run(installed, "--version", cwd=elsewhere)
    assert version.returncode == 0 and version.stdout.strip() == "keel 0.1.0", version.stderr
    sim = _run(installed, "simulate", "--json", cwd=elsewhere)  # no argument: the packaged default
    assert sim.returncode == 0, sim.stderr[-2000:]
    summary = json.loads(sim.stdout)
    assert summary["scenario"] == "multiregion-46" and summary["nodes"] == 46 and summary["restarts"] == 0
    shown = _run(installed, "scenario", "local-8", "--set", "run.steps=80", cwd=elsewhere)
    assert shown.returncode == 0, shown.stderr[-2000:]
    source = shown.stdout.splitlines()[0]
    assert "site-packages" in source and str(REPO) not in source  # the wheel's copy, not the checkout's
    assert "steps = 80" in shown.stdout
    by_name = _run(installed, "simulate", "multiregion-12", cwd=elsewhere)
    assert by_name.returncode == 0 and by_name.stdout.startswith("multiregion-12: 12 nodes"), by_name.stderr
    bad = _run(installed, "simulate", "multiregion-99", cwd=elsewhere)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "multiregion-99: no such scenario file, nor a packaged scenario (local-8, multiregion-12" in bad.stderr
    assert list(elsewhere.iterdir()) == []  # wrote nothing where it was run


def test_editable_install_finds_the_scenarios_as_a_package():
    """This checkout's own install (make's `pip install -e`): keel.scenarios is the top-level
    scenarios/ folder, through importlib.resources."""
    code = "from keel import paths; print(paths.SCENARIOS); print(paths.scenario_names())"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    folder, names = out.stdout.splitlines()
    assert Path(folder) == REPO / "scenarios"
    assert names == "['local-8', 'multiregion-12', 'multiregion-46', 'partition-12']"


def test_constraints_pin_what_the_makefile_installs():
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0"
    makefile = (REPO / "Makefile").read_text()
    assert "-c constraints.txt torch==" in makefile and "-c constraints.txt -e" in makefile
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    assert names <= set(pins), f"constraints.txt pins none of {sorted(names - set(pins))}"
