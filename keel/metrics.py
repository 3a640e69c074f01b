"""Metrics of a run, computed from its event log: the one place both twin and runtime use.

- `downtime_s` of a fault: from its `fault` event to the first step committed after it.
- `cost_s` of a fault: the extra wall time its episode added over the fault-free pace. The
  episode runs from the last commit before the fault to the first commit after the last event
  of that fault (`detail.fault_id`); its cost is its length minus the fault-free time of the
  net steps it advanced, so steps that had to be recomputed count as lost work.
- `lost_steps`: committed steps the fault threw away (recomputed after a restart).
- `goodput`: steps x fault-free step time / wall time.
- `restarts`: the number of `restart` events.

The fault-free step time comes from the caller, else from `detail.step_time_s` of the
`run_end` or `run_start` event, else from the median per-step interval between commits with
nothing else in between.
"""
from __future__ import annotations

import bisect
import statistics
from typing import Any, Sequence

from keel.events import Event

EPISODE_KINDS = ("fault", "detect", "recover_start", "recover_end", "reslot", "quarantine", "restart")


def fault_free_step_time(events: Sequence[Event]) -> float:
    for kind in ("run_end", "run_start"):
        for e in events:
            if e.kind == kind and e.detail.get("step_time_s"):
                return float(e.detail["step_time_s"])
    paces = []
    prev = None
    for e in events:
        if e.kind == "step":
            if prev is not None and e.step > prev.step:
                paces.append((e.t - prev.t) / (e.step - prev.step))
            prev = e
        elif e.kind not in ("run_start",):
            prev = None
    if not paces:  # every interval has something in it (a checkpoint every step, say)
        commits = [e for e in events if e.kind == "step"]
        paces = [(b.t - a.t) / (b.step - a.step) for a, b in zip(commits, commits[1:]) if b.step > a.step]
    if not paces:
        raise ValueError("fewer than two committed steps in the log to estimate the step time from")
    return statistics.median(paces)


def fault_episodes(events: Sequence[Event]) -> list[dict[str, Any]]:
    """Per fault: its class, target, action, when it struck and the episode's events."""
    episodes: dict[int, dict[str, Any]] = {}
    last_by_target: dict[tuple, int] = {}
    for i, e in enumerate(events):
        if e.kind == "fault":
            fid = e.fault_id if e.fault_id is not None else len(episodes)
            episodes[fid] = {"fault_id": fid, "class": e.fault, "target": e.target,
                             "action": e.action, "t": e.t, "at_step": e.step,
                             "first": i, "last": i}
            last_by_target[(e.fault, e.target)] = fid
        elif e.kind in EPISODE_KINDS:
            fid = e.fault_id
            if fid is None:
                fid = last_by_target.get((e.fault, e.target))
            ep = episodes.get(fid) if fid is not None else None
            if ep is None:
                continue
            ep["last"] = i
            if e.action and not ep["action"]:
                ep["action"] = e.action
            if e.kind == "restart":
                ep["action"] = "checkpoint_restart"
    return list(episodes.values())


def summarize(events: Sequence[Event], step_time_s: float | None = None) -> dict[str, Any]:
    """The metrics of one run. Both `keel simulate` and `keel run` write this to summary.json."""
    if not events:
        raise ValueError("empty event log")
    step = step_time_s if step_time_s is not None else fault_free_step_time(events)
    commits = [(i, e) for i, e in enumerate(events) if e.kind == "step"]
    commit_idx = [i for i, _ in commits]
    end = next((e for e in reversed(events) if e.kind == "run_end"), events[-1])
    start_t = next((e.t for e in events if e.kind == "run_start"), events[0].t)
    wall = end.t - start_t
    steps = end.step
    faults = []
    for ep in fault_episodes(events):
        # last commit at or before the fault, first commit after it, first after the episode
        k = bisect.bisect_left(commit_idx, ep["first"])
        before = commits[k - 1][1] if k > 0 else None
        after = commits[k][1] if k < len(commits) else None
        j = bisect.bisect_right(commit_idx, ep["last"])
        settled = commits[j][1] if j < len(commits) else None
        t0, s0 = (before.t, before.step) if before else (start_t, 0)
        downtime = (after.t - ep["t"]) if after else (end.t - ep["t"])
        if settled is not None:
            cost = (settled.t - t0) - (settled.step - s0) * step
            lost = max(0, s0 - settled.step + 1)
        else:
            cost = (end.t - t0) - (end.step - s0) * step
            lost = max(0, s0 - end.step)
        faults.append({
            "fault_id": ep["fault_id"], "class": ep["class"], "target": ep["target"],
            "action": ep["action"], "at_step": ep["at_step"], "t": ep["t"],
            "downtime_s": downtime, "cost_s": max(0.0, cost), "lost_steps": lost,
        })
    return {
        "steps": steps,
        "wall_s": wall,
        "step_time_s": step,
        "goodput": (steps * step / wall) if wall > 0 else 0.0,
        "restarts": sum(1 for e in events if e.kind == "restart"),
        "faults": faults,
    }


def restarts(events: Sequence[Event]) -> int:
    return sum(1 for e in events if e.kind == "restart")


def goodput(events: Sequence[Event], step_time_s: float | None = None) -> float:
    return summarize(events, step_time_s)["goodput"]


def downtime_s(events: Sequence[Event], step_time_s: float | None = None) -> list[float]:
    return [f["downtime_s"] for f in summarize(events, step_time_s)["faults"]]


def cost_s(events: Sequence[Event], step_time_s: float | None = None) -> list[float]:
    return [f["cost_s"] for f in summarize(events, step_time_s)["faults"]]
