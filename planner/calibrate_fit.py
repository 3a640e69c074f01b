"""Calibration's fitting: pure functions from the event logs of emulated runs to the twin's
primitives (no process, file or clock involved).

In an emulated cluster the hardware is the scenario's: compute, messages, storage and the
heartbeat timeout take the times the scenario gives them, and the twin takes those from the
scenario too. What is real is the runtime's own recovery work: the survivors leaving the
aborted generation, forming the next process group, a spare joining it. That is what a
calibration measures, from the runtime's event log, in the terms the twin composes a recovery
from (twin/model.py): after the node loss is known (the `reslot`), the job pauses for
`reform_s` (+ `spare_takeover_s` where a spare took over) + the state copy, then redoes the
interrupted step. The runtime times its own re-form: its `recover_end` carries `reform_s`
(leaving the aborted generation + forming the next group, `abort_s + pg_s`), which is the
pause. (Until issue 25 the pause was recover_end - reslot - the copy - the mean step of the
new generation; that also took in the compute the survivors finish before they see the abort,
which the twin now models itself (twin/cost.py, `drain_s`), and it put a rack loss's pause at
4.3 s where the runtime's re-form took 0.7 s.) Where an episode has no `reform_s`, the old
difference is used:
- `reform_s`: the pause of a rack loss that no spare absorbs (the survivors re-form);
- `spare_takeover_s`: a killed node's pause (a spare takes its slots) minus that.
A coordinator loss is timed by the runtime itself: its `recover_end` (under absorb) carries
`ack_s`, from the coordinator's death to the next generation announced (detection by the
supervisor, the successor's start, its state loaded, every worker rejoined), which is the
twin's `coordinator_restart_s` as it is:
- `coordinator_restart_s`: ack_s of each coordinator_loss episode;
- `coordinator_reform_s`: its reform_s minus its ack_s, the group the successor forms. Not the
  rack loss's re-form: under absorb the workers train on through the outage, so they re-form
  while busy, and the successor's group formed 1.15-1.75 times slower than a node or rack
  loss's in the same run (sweep members 1/6, 1/25, 1/26, 2/5, 2/7, 2/9; 6 Dec; read off their
  repetitions' recover_end events, no script kept).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from keel.calibration import MEASURED, entry, unit
from keel import fault_classes as FC
from keel.recovery import ABSORB_ACTION, COORDINATOR
from keel.metrics import fault_episodes, mean_step_s_after_warmup

RUN_KEYS = tuple(MEASURED)
HOW = {
    "reform_s": "rack loss, no spare left: recover_end.detail.reform_s (leaving the aborted generation + "
                "forming the next group), emulated runs",
    "spare_takeover_s": "killed node, a spare takes over: its reform_s minus the rack loss's, emulated runs",
    "coordinator_restart_s": "coordinator killed: recover_end.detail.ack_s (death to the next generation "
                             "announced), emulated runs",
    "coordinator_reform_s": "coordinator killed: recover_end.detail.reform_s minus its ack_s (the group its "
                            "successor forms while the workers train on), emulated runs",
}


QUICK_ENV = "KEEL_CALIBRATE_QUICK"  # "1": fewer repetitions (tests, the validation sweep)


def quick_from_env() -> bool:
    """Whether $KEEL_CALIBRATE_QUICK asks for a calibration's quick mode (keel calibrate, and
    the calibration keel validate measures when none is given or found)."""
    import os
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def generation_mean_step_s(events: Sequence[Any], gen: int) -> float | None:
    """The mean step of generation `gen` past its first commit (the redone step) and up to
    the next fault: what the twin takes for the step a recovery redoes, at the membership it
    redoes it with. None where fewer than two such commits."""
    commits = []
    for e in events:
        if e.kind == "step" and e.detail.get("gen") == gen:
            commits.append(e)
        elif e.kind == "fault" and commits:
            break
    if len(commits) < 2 or commits[-1].step == commits[0].step:
        return None
    return mean_step_s_after_warmup(commits, warmup=0)


def pauses(events: Sequence[Any]) -> dict[str, float]:
    """Per kind of node loss ("kill": one node, a spare taking over; "rack": a rack loss), the
    pause of its episode in the twin's terms (module docstring)."""
    out: dict[str, float] = {}
    for ep in fault_episodes(events):
        first = ep["first_of"]
        kind = FC.get(ep["class"]).node_loss
        if kind is None or not {"reslot", "recover_end"} <= set(first):
            continue
        end = first["recover_end"]
        if "reform_s" in end.detail:  # the runtime's own timing of the re-form (module docstring)
            out[kind] = float(end.detail["reform_s"])
            continue
        redo = generation_mean_step_s(events, end.detail["gen"]) if "gen" in end.detail else None
        if redo is None:
            continue
        out[kind] = end.t - first["reslot"].t - float(end.detail.get("state_s", 0.0)) - redo
    return out


def coordinator_failovers(events: Sequence[Any]) -> list[tuple[float, float | None]]:
    """(ack_s, reform_s - ack_s or None) of every coordinator_loss episode the runtime absorbed
    (its recover_end's)."""
    out = []
    for ep in fault_episodes(events):
        end = ep["first_of"].get("recover_end")
        if (ep["target"] == COORDINATOR and ep["action"] == ABSORB_ACTION[ep["class"]]
                and end is not None and "ack_s" in end.detail):
            ack = float(end.detail["ack_s"])
            reform = end.detail.get("reform_s")
            out.append((ack, max(0.0, float(reform) - ack) if reform is not None else None))
    return out


def run_samples(events: Sequence[Any]) -> dict[str, list[float]]:
    """What one calibration run's log says (RUN_KEYS)."""
    p = pauses(events)
    out: dict[str, list[float]] = {k: [] for k in RUN_KEYS}
    if "rack" in p:
        out["reform_s"].append(max(0.0, p["rack"]))
        if "kill" in p:
            out["spare_takeover_s"].append(max(0.0, p["kill"] - p["rack"]))
    for ack, reform in coordinator_failovers(events):
        out["coordinator_restart_s"].append(ack)
        if reform is not None:
            out["coordinator_reform_s"].append(reform)
    return out


def fit_calibration(samples: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """{"primitives", "missing"} of calibration.json from the pooled samples of the runs."""
    primitives = {name: entry(samples[name], unit(name), how=HOW[name]) for name in RUN_KEYS if samples.get(name)}
    return {"primitives": primitives, "missing": [n for n in RUN_KEYS if n not in primitives]}
