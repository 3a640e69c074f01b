"""checkpoint_restart on one node with exponential failures against the closed forms.

The twin's model for one node: failures at rate 1/M strike during work, checkpoint writes and
restarts (not while the dead node is being detected). A segment of length w (interval x step
time + the sync write delta; the last segment has no checkpoint) must run failure-free; a
failure costs the elapsed part, the detection D (mean detect_timeout - heartbeat / 2), then a
recovery R (restart_s + the checkpoint load; no load before the first checkpoint) that must
itself run failure-free. Renewal arguments give, per segment,

    E[T] = (e^(w/M) - 1) (M + D) e^(R/M),

Daly's expected wall time (2006) with detection added (D = 0 is Daly's formula exactly). The
optimal interval is Daly's tau_opt = sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + delta / 9M) - delta,
which refines Young's sqrt(2 delta M).
"""
from __future__ import annotations

import math

import pytest

import twin
from keel.scenario import from_dict

pytestmark = pytest.mark.timeout(120)

M = 2000.0          # node MTBF, s
DELTA = 20.0        # sync checkpoint write: 20 GB at 1 GB/s
LOAD = 5.0          # checkpoint read: 20 GB at 4 GB/s
RESTART = 30.0
STEPS = 20000       # 1 s steps: 10 MTBFs of work
DETECT = 5.0 - 1.0 / 2
REPLICAS = 160


def single_node(interval: int):
    return from_dict({
        "run": {"name": "daly", "seed": 1, "steps": STEPS},
        "workload": {"step_compute_s": 1.0, "compute_jitter": 0.0, "gradient_bytes": 0, "slots": 1},
        "checkpoint": {"interval_steps": interval, "mode": "sync", "weights_bytes": 20_000_000_000,
                       "optimizer_bytes": 0, "write_gbyte_s": 1.0, "read_gbyte_s": 4.0},
        "regions": [{"name": "solo", "nodes": 1}],
        "faults": {"hardware_fault": {"mtbf_node_hours": M / 3600}},
        "policy": {"kind": "checkpoint_restart", "heartbeat_s": 1.0, "detect_timeout_s": 5.0,
                   "hot_spares": 0, "restart_s": RESTART, "replace_node_s": 0.0},
    }, "daly")


def expected_wall_s(interval: int) -> float:
    total = 0.0
    for i in range(math.ceil(STEPS / interval)):
        work = min(interval, STEPS - i * interval)
        w = work + (DELTA if (i + 1) * interval < STEPS else 0.0)
        recovery = RESTART + (LOAD if i > 0 else 0.0)
        total += math.expm1(w / M) * (M + DETECT) * math.exp(recovery / M)
    return total


def daly_interval() -> float:
    return math.sqrt(2 * DELTA * M) * (1 + math.sqrt(DELTA / (2 * M)) / 3 + DELTA / (9 * M)) - DELTA


def test_closed_form_optimum_is_dalys_interval():
    exact = min(range(50, 2000), key=expected_wall_s)
    assert abs(exact - daly_interval()) / daly_interval() < 0.03
    assert abs(exact - math.sqrt(2 * DELTA * M)) / exact < 0.06  # Young's first-order figure


@pytest.fixture(scope="module")
def measured() -> dict[int, dict]:
    tau = round(daly_interval())
    return {interval: twin.simulate_replicas(single_node(interval), REPLICAS, seed=100, processes=2,
                                             progress=False)
            for interval in (tau // 3, tau, tau * 3)}


def test_goodput_matches_the_expected_wall_time(measured):
    for interval, result in measured.items():
        predicted = STEPS / expected_wall_s(interval)
        assert result["goodput"] == pytest.approx(predicted, abs=0.01), interval
        assert result["restarts"] > 5


def test_dalys_interval_is_the_best_measured(measured):
    best = max(measured, key=lambda k: measured[k]["goodput"])
    assert best == round(daly_interval())
