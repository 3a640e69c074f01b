"""The runs the dashboard tests read (no tests here): produced once per session through the
public CLIs with tiny settings (twin, planner, validate = runtime + twin), plus hand-written
directories in the documented formats (docs/design.md) for what must not depend on a
producer. A producer missing from the checkout gives None and a reason to skip with."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel import metrics
from keel.events import Event, write_events

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "scenarios" / "local-8.toml"
DEFAULT = REPO / "scenarios" / "multiregion-46.toml"
_made: dict[str, tuple[Path | None, str]] = {}


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def keel(*args: str, timeout: float, ok=(0,), **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_vars)
    proc = subprocess.run([sys.executable, "-m", "keel.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode in ok, f"keel {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


_failed: dict[str, str] = {}


def _once(name: str, make) -> tuple[Path | None, str]:
    """Each producer runs once a session; one that failed is not retried by every test that
    needs it: they fail at once with its message."""
    if name in _failed:
        pytest.fail(f"(producing {name} failed earlier in this session) {_failed[name]}", pytrace=False)
    if name not in _made:
        try:
            _made[name] = make()
        except BaseException as e:
            _failed[name] = f"{type(e).__name__}: {e}"[-4000:]
            raise
    return _made[name]


def twin_ok() -> bool:
    if not available("twin.cli"):
        return False
    import twin
    return hasattr(twin, "simulate")


# ----------------------------------------------------------------------------- producers

def twin_run(root: Path) -> tuple[Path | None, str]:
    """`keel simulate scenarios/local-8.toml --out ROOT/sim-local-8` (all four fault classes)."""
    def make():
        if not twin_ok():
            return None, "the twin (twin.simulate, twin/cli.py) is not in this checkout yet"
        out = root / "sim-local-8"
        keel("simulate", str(LOCAL), "--out", str(out), timeout=120)
        return out, ""
    return _once("twin", make)


def plan_run(root: Path) -> tuple[Path | None, str]:
    """`keel plan scenarios/local-8.toml --trials 4 --replicas 1 --out ROOT/plan-local-8`."""
    def make():
        if not (twin_ok() and available("planner.cli") and available("planner.search")):
            return None, "the planner (planner/cli.py plan) is not in this checkout yet"
        out = root / "plan-local-8"
        keel("plan", str(LOCAL), "--trials", "4", "--replicas", "1", "--out", str(out), timeout=240)
        return out, ""
    return _once("plan", make)


# the emulated cluster validate runs here, with a checkpoint every 5 steps (the checkpoint pages)
EMULATED = REPO / "scenarios" / "multiregion-12.toml"
EMULATED_SETTINGS = ("--set", "checkpoint.interval_steps=5")


# what the producers' commands printed with --json (and their exit codes): the planner's tests
# (tests/test_planner_runtime.py) judge the same calibration and validation the pages show
printed: dict[str, subprocess.CompletedProcess] = {}


def calibration(root: Path) -> tuple[Path | None, str]:
    """`keel calibrate scenarios/multiregion-12.toml` in its quick mode (KEEL_CALIBRATE_QUICK=1,
    the planner's switch for tests)."""
    def make():
        if not available("planner.calibrate"):
            return None, "keel calibrate (planner/calibrate.py) is not in this checkout yet"
        out = root / "calibration.json"
        printed["calibration"] = keel("calibrate", str(EMULATED), *EMULATED_SETTINGS, "--out", str(out), "--json",
                                      timeout=480, KEEL_CALIBRATE_QUICK="1")
        return out, ""
    return _once("calibration", make)


def validation_run(root: Path) -> tuple[Path | None, str]:
    """`keel validate scenarios/multiregion-12.toml` (emulated, its two runtime repetitions) on
    a quick calibration: comparison.json, twin/, runtime/rep-0/ and rep-1/."""
    def make():
        if not (twin_ok() and available("planner.validate") and available("runtime.api")):
            return None, "keel validate (planner/validate.py + runtime/api.py) is not in this checkout yet"
        cal, why = calibration(root)
        if cal is None:
            return None, why
        out = root / "validate-multiregion-12"
        # exit 1 = it ran and the comparison failed its tolerances: still a real comparison
        proc = printed["validation"] = keel("validate", str(EMULATED), *EMULATED_SETTINGS, "--calibration", str(cal),
                                            "--out", str(out), "--json", timeout=900, ok=(0, 1))
        assert (out / "comparison.json").is_file(), f"keel validate wrote no comparison.json:\n{proc.stderr[-3000:]}"
        return out, ""
    return _once("validation", make)


def checkpointed_run(root: Path) -> tuple[Path | None, str]:
    """A runtime run with checkpoints: the validation's runtime/rep-0."""
    path, why = validation_run(root)
    if path is None:
        return None, why
    rep = path / "runtime" / "rep-0"
    if not (rep / "checkpoints").is_dir():
        return None, f"{rep}: the runtime wrote no checkpoints/"
    return rep, ""


# ----------------------------------------------------------------------------- hand-written

def _events(step_s: float, faults: list[tuple[int, str, str, str, float]], steps: int = 30,
            launch: float = 0.0) -> list[Event]:
    """A schema-correct event log: `faults` = (at_step, class, target, action, downtime);
    training starts `launch` seconds after run_start (the runtime's process start-up)."""
    ev = [Event(0.0, 0, "run_start", detail={"step_time_s": step_s})]
    t, fid = launch, 0
    by_step = {f[0]: f for f in faults}
    for s in range(steps):
        if s in by_step:
            _, cls, target, action, down = by_step[s]
            d = {"fault_id": fid}
            ev += [Event(t + 0.001, s, "fault", cls, target, action, d),
                   Event(t + down * 0.5, s, "detect", cls, target, action, d),
                   Event(t + down * 0.6, s, "recover_start", cls, target, action, d),
                   Event(t + down * 0.9, s, "recover_end", cls, target, action, d)]
            t += down
            fid += 1
        if s == 10:
            ev += [Event(t, s, "checkpoint_start"), Event(t + 0.002, s, "checkpoint_end")]
        t += step_s
        ev.append(Event(round(t, 6), s + 1, "step"))
    ev.append(Event(round(t, 6), steps, "run_end", detail={"step_time_s": step_s}))
    return ev


FAULTS = [(5, "hardware_fault", "us-east/1", "replicate_resume"),
          (12, "network_jitter", "eu-west/0", "backpressure_reslot"),
          (18, "partial_cluster_loss", "ap-southeast", "shard_reweight_failover"),
          (24, "data_shard_skew", "shard/3", "quarantine_resample")]


def write_run(out: Path, events: list[Event], tool: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    write_events(out / "events.jsonl", events)
    summary = {**metrics.summarize(events), "tool": tool, "scenario": "local-8", "config_hash": "0" * 64,
               "seed": 1, "nodes": 8, "regions": 4, "policy": "absorb"}
    (out / "summary.json").write_text(json.dumps(summary))
    return summary


def handwritten_validation(root: Path, passing: bool = False) -> Path:
    """A validation directory in the documented comparison.json format, with twin/ and two
    runtime repetitions; the network_jitter fault is off by 30% (a failing verdict) unless
    `passing`."""
    out = root / ("handwritten-validation-pass" if passing else "handwritten-validation")
    if (out / "comparison.json").is_file():
        return out
    predicted = [0.30, 0.20, 0.40, 0.10]
    factors = [[1.02, 0.97], [1.0, 1.01] if passing else [1.3, 1.28], [0.95, 1.05], [1.0, 1.04]]
    twin = write_run(out / "twin", _events(0.02, [(*f, d) for f, d in zip(FAULTS, predicted)]), "twin")
    launch = [0.8, 0.6]  # the runtime's start-up before training, which the twin does not model
    reps = [write_run(out / "runtime" / f"rep-{k}",
                      _events(0.021, [(*f, d * fac[k]) for f, d, fac in zip(FAULTS, predicted, factors)],
                              launch=launch[k]), "runtime")
            for k in range(2)]
    faults, errs = [], []
    for i, (f, tf) in enumerate(zip(FAULTS, twin["faults"])):
        obs = [r["faults"][i]["downtime_s"] for r in reps]
        cost = [r["faults"][i]["cost_s"] for r in reps]
        mean = sum(obs) / len(obs)
        err = abs(mean - tf["downtime_s"]) / tf["downtime_s"]
        errs.append(err)
        faults.append({"fault_id": i, "class": f[1], "target": f[2], "action": f[3], "at_step": f[0],
                       "predicted": {"downtime_s": tf["downtime_s"], "cost_s": tf["cost_s"],
                                     "downtime_ci95": [tf["downtime_s"] * 0.93, tf["downtime_s"] * 1.07],
                                     "cost_ci95": [tf["cost_s"] * 0.9, tf["cost_s"] * 1.1]},
                       "observed": {"downtime_s": mean, "cost_s": sum(cost) / len(cost),
                                    "downtime_s_reps": obs, "cost_s_reps": cost},
                       "downtime_rel_err": err, "cost_rel_err": err})
    median = sorted(errs)[len(errs) // 2]
    wall_obs = [r["wall_s"] - launch[k] for k, r in enumerate(reps)]
    wall_err = abs(sum(wall_obs) / 2 - twin["wall_s"]) / twin["wall_s"]
    comparison = {
        "scenario": "local-8", "config_hash": "0" * 64, "calibration": "calibration.json", "repetitions": 2,
        "tolerances": {"downtime_rel_tol": 0.10, "wall_rel_tol": 0.05}, "faults": faults,
        "wall_s": {"predicted": twin["wall_s"], "observed": sum(wall_obs) / 2, "observed_reps": wall_obs,
                   "predicted_ci95": [twin["wall_s"] * 0.98, twin["wall_s"] * 1.02], "rel_err": wall_err,
                   "launch_s_reps": launch},
        "goodput": {"predicted": twin["goodput"], "observed": reps[0]["goodput"],
                    "observed_reps": [r["goodput"] for r in reps], "rel_err": 0.05},
        "downtime_median_rel_err": median,
        "pass": {"downtime": median <= 0.10, "wall": wall_err <= 0.05, "all": median <= 0.10 and wall_err <= 0.05},
    }
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1))
    return out


def handwritten_plan(root: Path) -> Path:
    """A plan.json in the documented format (what `keel plan --out` writes)."""
    out = root / "handwritten-plan"
    out.mkdir(parents=True, exist_ok=True)
    trials = []
    for n, (spares, interval, kind, good, cost) in enumerate([
            (2, 200, "absorb", 0.93, 0.0110), (0, 200, "absorb", 0.90, 0.0100), (4, 100, "absorb", 0.94, 0.0125),
            (2, 400, "absorb", 0.91, 0.0111), (0, 150, "checkpoint_restart", 0.78, 0.0100)]):
        trials.append({"number": n, "source": "tpe",
                       "policy": {"policy.hot_spares": spares, "checkpoint.interval_steps": interval, "policy.kind": kind},
                       "goodput": good, "goodput_ci95": [good - 0.01, good + 0.01], "cost_node_hours_per_step": cost})

    def flat(t: dict) -> dict:
        return {**t["policy"], "goodput": t["goodput"], "goodput_ci95": t["goodput_ci95"],
                "cost_node_hours_per_step": t["cost_node_hours_per_step"],
                "set": [f"{k}={json.dumps(v)}" for k, v in t["policy"].items()], "source": t["source"]}
    pareto = [trials[1], trials[0], trials[2]]
    plan = {"scenario": "multiregion-46", "replicas": 2, "recommended": flat(trials[0]), "baseline": flat(trials[4]),
            "pareto": pareto, "trials": sorted(trials, key=lambda t: -t["goodput"])}
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    return out


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    """One runs directory for the session: every producer writes its run under it."""
    return _once("root", lambda: (tmp_path_factory.mktemp("runs"), ""))[0]


def need(made: tuple[Path | None, str]) -> Path:
    path, why = made
    if path is None:
        pytest.skip(why)
    return path
