"""Every primitive the twin's model uses, in one frozen dataclass: the calibration hook.

`TwinParams.from_scenario(scenario)` derives them from the scenario (and its topology);
`TwinParams.from_scenario(scenario, calibration)` takes each one that a calibration measured
from `calibration["primitives"][name]["median"]` (`keel calibrate` writes that file) and
falls back to the scenario for the names it lacks. Names the twin does not know are ignored,
so a calibration may carry more measurements than the twin uses. The file's format, and its
reading and checking, live in `keel/calibration.py`.

Calibrated primitives (name: what it is; where the scenario value comes from):
  slot_compute_s          one slot's micro-batch on one nominal node, s (workload.step_compute_s)
  step_overhead_s         fixed per-step cost beyond compute and reduction, s (0)
  reduce_latency_s        latency term of one all-reduce over the full membership, s (topology)
  reduce_gbyte_s          effective all-reduce bandwidth: gradient bytes / bandwidth term, GB/s (topology)
  detect_kill_s           mean time to detect a node that crashed at a random moment (a drawn
                          `hardware_fault`), s: a crashed machine sends nothing and is found by the
                          heartbeat timeout, detect_timeout_s - heartbeat_s / 2 (the timeout runs
                          from its last message, a uniform phase before the crash). A calibration
                          may give it (a process death on a live machine, seen as connection loss)
  detect_rack_s           the same for a rack loss (`partial_cluster_loss`), s (default: detect_kill_s)
  reform_s                survivors re-form the group (new generation, fresh process group), s
                          (0.1: the 70-130 ms measured with gloo on the 2-core test bed; `keel calibrate`
                          measures it in emulated runs of the scenario)
  state_transfer_gbyte_s  peer-to-peer state copy between two nodes, GB/s (first region's
                          node bandwidth; the topology scales it for other routes)
  spare_takeover_s        a hot spare joins and takes over slots (beyond the state copy), s (0;
                          `keel calibrate` measures it)
  ckpt_snapshot_gbyte_s   per-node device-to-host snapshot of async checkpoints, GB/s (checkpoint.snapshot_gbyte_s)
  ckpt_write_gbyte_s      per-node checkpoint write, GB/s (checkpoint.write_gbyte_s)
  ckpt_read_gbyte_s       per-node checkpoint read, GB/s (checkpoint.read_gbyte_s)
  restart_s               relaunch and rendezvous of the whole job, s (policy.restart_s)
  coordinator_restart_s   from a coordinator's death until its successor is up, its state loaded
                          and every worker rejoined (the next generation announced), s
                          (policy.coordinator_restart_s; `keel calibrate` measures it: the median
                          ack_s of coordinator_loss episodes)
  coordinator_reform_s    under absorb, the group the successor forms once it is up, s (default:
                          reform_s; `keel calibrate` measures it on its own: the workers train on
                          through the outage and re-form while busy, slower than after a node loss)
  detect_at_commit_s      not calibrated: a scheduled crash strikes right after a commit, when the
                          node's last message (its step report) is fresh, so the whole
                          detect_timeout_s runs; None where
                          detect_kill_s is calibrated (a process death seen as connection loss)

Nothing here describes the machine the tests run on: an emulated cluster's compute, network,
storage and detection are the scenario's, and a calibration measures only the runtime's own
recovery work (planner/calibrate_fit.py).

Reductions and transfers over memberships or routes other than the reference ones keep the
topology's shape: the model scales the topology's figures by calibrated / reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from keel.calibration import CalibrationError, load as load_calibration, medians
from keel.scenario import Scenario, region_of
from twin.topology import Topology

__all__ = ["TwinParams", "CalibrationError", "load_calibration", "DEFAULT_REFORM_S"]

DEFAULT_REFORM_S = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class TwinParams:
    slot_compute_s: float
    step_overhead_s: float
    reduce_latency_s: float
    reduce_gbyte_s: float
    detect_kill_s: float
    reform_s: float
    state_transfer_gbyte_s: float
    spare_takeover_s: float
    ckpt_snapshot_gbyte_s: float
    ckpt_write_gbyte_s: float
    ckpt_read_gbyte_s: float
    restart_s: float
    coordinator_restart_s: float
    coordinator_reform_s: float
    detect_rack_s: float | None = None  # None: as detect_kill_s
    # not calibrated: taken from the scenario as they are
    detect_at_commit_s: float | None = None  # a crash right after a commit (scheduled faults); None: as detect_kill_s
    compute_jitter: float = 0.0
    heartbeat_s: float = 1.0
    replace_node_s: float = 0.0
    calibrated: tuple[str, ...] = ()

    @classmethod
    def from_scenario(cls, scenario: Scenario, calibration: dict | None = None,
                      source: str = "calibration", topology: Topology | None = None) -> "TwinParams":
        topology = topology or Topology(scenario)
        p = scenario.policy
        c = scenario.checkpoint
        active: dict[str, int] = {}
        for name in scenario.node_names[: scenario.training_nodes]:
            region = region_of(name)
            active[region] = active.get(region, 0) + 1
        reduction = topology.reduction(active)
        detect = p.detect_timeout_s - p.heartbeat_s / 2
        values: dict[str, float] = {
            "slot_compute_s": scenario.workload.step_compute_s,
            "step_overhead_s": 0.0,
            "reduce_latency_s": reduction.latency_s,
            "reduce_gbyte_s": (1.0 / reduction.s_per_byte / 1e9) if reduction.s_per_byte > 0 else math.inf,
            "detect_kill_s": detect,
            "reform_s": DEFAULT_REFORM_S,
            "state_transfer_gbyte_s": topology.reference_transfer_gbyte_s(),
            "spare_takeover_s": 0.0,
            "ckpt_snapshot_gbyte_s": c.snapshot_gbyte_s,
            "ckpt_write_gbyte_s": c.write_gbyte_s,
            "ckpt_read_gbyte_s": c.read_gbyte_s,
            "restart_s": p.restart_s,
            "coordinator_restart_s": p.coordinator_restart_s,
        }
        measured = medians(calibration, source) if calibration is not None else {}
        values.update(measured)
        if "detect_rack_s" not in values:
            values["detect_rack_s"] = values["detect_kill_s"]
        if "coordinator_reform_s" not in values:
            values["coordinator_reform_s"] = values["reform_s"]
        # A scheduled crash strikes right after a commit, when the node's last message (its step
        # report; any message counts as a heartbeat) is fresh: the full timeout runs from that
        # message. A calibrated detect_kill_s (a process death seen as connection loss) holds
        # for it too.
        at_commit = None if "detect_kill_s" in measured else p.detect_timeout_s
        return cls(**values, compute_jitter=scenario.workload.compute_jitter, detect_at_commit_s=at_commit,
                   heartbeat_s=p.heartbeat_s, replace_node_s=p.replace_node_s,
                   calibrated=tuple(sorted(measured)))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

