"""The planner against the real runtime: calibrate measures the real part of an emulated
cluster, validate judges the twin against emulated runs of scenarios/multiregion-12.toml (the
default cluster's shape at 12 nodes) within its declared tolerances, plan --validate confirms
the predicted ordering. Real processes; every test has a timeout."""
import datetime
import importlib.util
import json
import os
import subprocess

import pytest

import test_app_runs as shared
from conftest import SCENARIOS, keel_cmd
from test_app_runs import need, runs_root  # noqa: F401 (runs_root: a fixture)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("runtime.api") is None,
                                reason="runtime.api (the runtime's entry point) is not there yet")

EMULATED = SCENARIOS / "multiregion-12.toml"


def _keel(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(keel_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def calibration(runs_root):
    """One quick calibration of the emulated 12-node cluster (checkpoints every 5 steps), the
    one the dashboard's tests read too (tests/test_app_runs.py: made once a session)."""
    path = need(shared.calibration(runs_root))
    return path, json.loads(shared.printed["calibration"].stdout)


@pytest.mark.timeout(540)
def test_calibrate_measures_the_real_recovery_work(calibration):
    path, printed = calibration
    cal = json.loads(path.read_text())
    assert cal == printed
    assert set(cal["primitives"]) == {"reform_s", "spare_takeover_s", "coordinator_restart_s", "coordinator_reform_s"}
    assert cal["missing"] == []
    for name, e in cal["primitives"].items():
        assert e["unit"] == "s" and len(e["samples"]) == cal["reference"]["runs"] == 2, name
        assert e["spread"][0] <= e["median"] <= e["spread"][1] and e["median"] >= 0, name
    # re-forming a group is real work: it takes time, and well under the heartbeat timeout
    assert 0 < cal["primitives"]["reform_s"]["median"] < 5.0
    # a successor coordinator starts, loads the state and has every worker back: real work too
    assert cal["primitives"]["coordinator_restart_s"]["median"] > 0
    from keel import scenario as S
    sc = S.load(EMULATED)
    assert cal["reference"]["nodes"] == sc.total_nodes and cal["reference"]["time_scale"] == sc.emulation.time_scale
    assert {"platform", "cpu_count", "hostname"} <= set(cal["machine"])
    assert {"python", "torch", "numpy"} <= set(cal["versions"])
    assert datetime.datetime.fromisoformat(cal["created"]).tzinfo is not None
    from twin.params import TwinParams, load_calibration
    params = TwinParams.from_scenario(sc, load_calibration(path))
    assert params.calibrated == ("coordinator_reform_s", "coordinator_restart_s", "reform_s", "spare_takeover_s")


@pytest.fixture(scope="module")
def validation(calibration, runs_root):
    """One `keel validate` of the emulated 12-node cluster on that calibration, the one the
    dashboard's tests read too."""
    out = need(shared.validation_run(runs_root))
    p = shared.printed["validation"]
    return out, p, json.loads(p.stdout)


@pytest.mark.timeout(1440)
def test_validate_writes_a_complete_comparison_and_a_consistent_verdict(validation):
    out, p, comparison = validation
    assert json.loads((out / "comparison.json").read_text()) == comparison
    assert (out / "twin" / "events.jsonl").exists() and (out / "twin" / "summary.json").exists()
    from keel import scenario as S
    sc = S.load(EMULATED)
    n = sc.validate.repetitions
    for k in range(n):
        assert (out / "runtime" / f"rep-{k}" / "events.jsonl").exists()
    assert comparison["repetitions"] == n and comparison["calibration_source"] == "given"
    assert {f["class"] for f in comparison["faults"]} == {"hardware_fault", "network_jitter",
                                                           "partial_cluster_loss", "data_shard_skew"}
    for f in comparison["faults"]:
        assert len(f["observed"]["downtime_s_reps"]) == n
        lo, hi = f["predicted"]["downtime_ci95"]
        assert lo <= f["predicted"]["downtime_s"] <= hi
        assert f["downtime_rel_err"] == pytest.approx(
            abs(f["predicted"]["downtime_s"] - f["observed"]["downtime_s"]) / f["observed"]["downtime_s"])
    # every repetition ran emulated, with its faithfulness on record
    assert len(comparison["emulation"]) == n and all(e and e["reports"] > 0 for e in comparison["emulation"])
    # goodput is bounded by 1, predicted and observed alike
    assert 0 < comparison["goodput"]["predicted"] <= 1 and 0 < comparison["goodput"]["observed"] <= 1
    tol = comparison["tolerances"]
    verdict = comparison["pass"]
    assert verdict["downtime"] == (comparison["downtime_median_rel_err"] <= tol["downtime_rel_tol"])
    assert verdict["each_fault"] == all(f["downtime_rel_err"] <= tol["fault_rel_tol"] for f in comparison["faults"])
    assert verdict["wall"] == (comparison["wall_s"]["rel_err"] <= tol["wall_rel_tol"])
    assert verdict["valid"] == all(e["faithful"] for e in comparison["emulation"])
    assert verdict["all"] == (verdict["downtime"] and verdict["each_fault"] and verdict["wall"] and verdict["valid"])
    assert p.returncode == (0 if verdict["all"] else 1)


@pytest.mark.timeout(1440)
def test_validate_of_the_emulated_cluster_passes_its_tolerances(validation):
    _, _, comparison = validation
    summary = "; ".join(f"{f['class']} {f['downtime_rel_err']:.1%}" for f in comparison["faults"])
    assert comparison["pass"]["all"], (f"downtime median error {comparison['downtime_median_rel_err']:.1%} "
                                       f"({summary}), wall error {comparison['wall_s']['rel_err']:.1%}, "
                                       f"emulation {comparison['emulation']}")


# local-8's shape cut to two regions and one killed worker: the baseline's restart (a relaunch
# of every worker) is the slow part, so one fault keeps the test short. The checkpoint figures
# are the twin's (a 0.1 s write), so Young/Daly's interval is ~10 steps, not 1.
SMALL_LOCAL = """
[run]
name = "local-4"
seed = 1
steps = 30
[workload]
step_compute_s = 0.02
gradient_bytes = 500_000
slots = 4
micro_batch = 4
[checkpoint]
interval_steps = 10
weights_bytes = 50_000_000
optimizer_bytes = 100_000_000
write_gbyte_s = 0.5
read_gbyte_s = 1.0
[[regions]]
name = "us-east"
nodes = 2
gpus_per_node = 1
intra_gbit_s = 10.0
[[regions]]
name = "us-west"
nodes = 2
gpus_per_node = 1
intra_gbit_s = 10.0
[[links]]
a = "us-east"
b = "us-west"
rtt_ms = 0.1
gbit_s = 10.0
[[faults.schedule]]
at_step = 12
class = "hardware_fault"
target = "us-east/1"
[policy]
heartbeat_s = 0.1
detect_timeout_s = 1.0
hot_spares = 1
restart_s = 7.0
replace_node_s = 0.0
"""


@pytest.mark.timeout(540)
def test_plan_validate_confirms_the_ordering_on_the_runtime(tmp_path):
    scenario = tmp_path / "local-4.toml"
    scenario.write_text(SMALL_LOCAL)
    p = _keel("plan", str(scenario), "--trials", "6", "--replicas", "2", "--validate",
              "--out", str(tmp_path / "plan"), "--json", timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    v = json.loads(p.stdout)["validation"]
    assert v["baseline"]["policy"]["policy.kind"] == "checkpoint_restart"
    assert v["predicted_order"] == v["observed_order"] == "recommended"
    assert v["ordering_matches"]
    assert v["baseline"]["restarts"] >= 1 and v["recommended"]["restarts"] == 0
