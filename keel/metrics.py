"""Metrics of a run, computed from its event log: the one place both twin and runtime use.

- `downtime_s` of a fault: from its `fault` event to the first step committed after it.
- `cost_s` of a fault: the extra wall time its episode added over the fault-free pace. The
  episode runs from the last commit before the fault to the first commit after the last event
  of that fault (`detail.fault_id`); its cost is its length minus the fault-free time of the
  net steps it advanced, so steps that had to be recomputed count as lost work.
- `lost_steps`: committed steps the fault threw away (recomputed after a restart).
- `goodput`: steps x fault-free step time / wall time, at most 1 (`goodput`).
- `restarts`: the number of `restart` events.
- `open_at_end(events)`: the latency spikes a completed run closes at its end (`recover_end`
  with `at_run_end`); such an episode's cost runs to the end of the run, which it lasted.

The fault-free step time comes from the caller, else from `detail.step_time_s` of the
`run_end` or `run_start` event, else from the median per-step interval between commits with
nothing else in between.

The one episode walker is `fault_episodes` (summarize, validate, calibrate and the app read
episodes through it). The pace estimators, each named for what it computes:
- `median_clean_interval_s(events)`: the median per-step interval between consecutive commits
  with nothing else between them (the metrics' fallback step time);
- `median_full_membership_interval_s(intervals, full_members)`: the same over (members, s)
  intervals a coordinator measured, at the full membership, past the first two (the runtime's
  reported `step_time_s`);
- `mean_step_s_after_warmup(events, warmup)`: the commits past the first `warmup` over the time
  they took, everything included (what a run's wall time grows by per step: calibration's pace).
"""
from __future__ import annotations

import bisect
import statistics
from typing import Any, Sequence

from keel import fault_classes as FC
from keel.events import Event

EPISODE_KINDS = ("fault", "detect", "recover_start", "recover_end", "reslot", "quarantine", "restart")


def clean_intervals(events: Sequence[Event]) -> list[float]:
    """Seconds per step between consecutive commits with nothing but a `run_start` between them."""
    paces = []
    prev = None
    for e in events:
        if e.kind == "step":
            if prev is not None and e.step > prev.step:
                paces.append((e.t - prev.t) / (e.step - prev.step))
            prev = e
        elif e.kind not in ("run_start",):
            prev = None
    return paces


def median_clean_interval_s(events: Sequence[Event]) -> float:
    """The median of `clean_intervals`; where every interval has something in it (a checkpoint
    every step, say), the median over all consecutive commits."""
    paces = clean_intervals(events)
    if not paces:
        commits = [e for e in events if e.kind == "step"]
        paces = [(b.t - a.t) / (b.step - a.step) for a, b in zip(commits, commits[1:]) if b.step > a.step]
    if not paces:
        raise ValueError("fewer than two committed steps in the log to estimate the step time from")
    return statistics.median(paces)


def median_full_membership_interval_s(intervals: Sequence[tuple[int, float]], full_members: int,
                                      warmup: int = 2) -> float | None:
    """The median of clean commit intervals given as (members holding slots, seconds), taken
    where the membership was `full_members` (steps with fewer workers, after a loss or with a
    straggler parked, are part of what the faults did), every interval where none was; past the
    first `warmup` where more than twice that many remain. None without intervals. (Until 6 Dec
    every interval where fewer than 3 were at the full membership: a sweep member with
    checkpoints every 3 steps and a region lost at step 6 had 2, and its pace came out as the
    smaller cluster's, 1.78 s for 1.25 s.)"""
    healthy = [dt for members, dt in intervals if members == full_members]
    xs = healthy or [dt for _, dt in intervals]
    xs = xs[warmup:] if len(xs) > 2 * warmup else xs
    return statistics.median(xs) if xs else None


def mean_step_s_after_warmup(events: Sequence[Event], warmup: int = 2) -> float:
    """The mean step of the commits in `events` past the first `warmup`: steps over the time
    they took, checkpoints and the machine's hiccups included. A run's wall time grows by this
    per step, so it is the mean, not a median (a few slow steps in every stretch put it 2-10 %
    above the median interval). Needs two commits at distinct steps."""
    commits = [(e.step, e.t) for e in events if e.kind == "step"]
    (s0, t0), (s1, t1) = commits[min(warmup, len(commits) - 2)], commits[-1]
    return (t1 - t0) / (s1 - s0)


def fault_free_step_time(events: Sequence[Event]) -> float:
    """The step time a log declares (`detail.step_time_s` of its `run_end`, else `run_start`),
    else `median_clean_interval_s`."""
    for kind in ("run_end", "run_start"):
        for e in events:
            if e.kind == kind and e.detail.get("step_time_s"):
                return float(e.detail["step_time_s"])
    return median_clean_interval_s(events)


def fault_episodes(events: Sequence[Event]) -> list[dict[str, Any]]:
    """Per fault, in the order they struck: its `fault_id`, `class`, `target`, `action`, the
    time `t` and step `at_step` it struck at, the indices in `events` of its `fault` event
    (`first`) and of its episode's last event (`last`), that event's time `end_t`, and
    `first_of`: the episode's first event of each kind. An episode's events are those of
    EPISODE_KINDS carrying its `detail.fault_id` (or, without one, the latest fault's of the
    same class and target)."""
    episodes: dict[int, dict[str, Any]] = {}
    last_by_target: dict[tuple, int] = {}
    for i, e in enumerate(events):
        if e.kind == "fault":
            fid = e.fault_id if e.fault_id is not None else len(episodes)
            episodes[fid] = {"fault_id": fid, "class": e.fault, "target": e.target,
                             "action": e.action, "t": e.t, "at_step": e.step,
                             "first": i, "last": i, "end_t": e.t, "first_of": {"fault": e}}
            last_by_target[(e.fault, e.target)] = fid
        elif e.kind in EPISODE_KINDS:
            fid = e.fault_id
            if fid is None:
                fid = last_by_target.get((e.fault, e.target))
            ep = episodes.get(fid) if fid is not None else None
            if ep is None:
                continue
            ep["last"], ep["end_t"] = i, e.t
            ep["first_of"].setdefault(e.kind, e)
            if e.action and not ep["action"]:
                ep["action"] = e.action
            if e.kind == "restart":
                ep["action"] = "checkpoint_restart"
    return list(episodes.values())


def open_at_end(events: Sequence[Event]) -> list[int]:
    """The episodes with a duration (keel.fault_classes: latency spikes) that have no `recover_end` yet, in the order they struck: a
    spike still on, or its straggler still parked, when the run ends. A completed run closes
    each just before its `run_end`, with a `recover_end` marked `at_run_end`; the twin and the
    runtime both call this, so both close the same episodes. (Every other episode ends with a
    commit; the twin's fault on an idle spare, which costs nothing, has no other event.)"""
    return [ep["fault_id"] for ep in fault_episodes(events)
            if FC.get(ep["class"]).has_duration and "recover_end" not in ep["first_of"]]


def since_fault_s(episode: dict[str, Any], kind: str) -> float | None:
    """Seconds from the episode's fault to its first event of `kind` (None where none came)."""
    e = episode["first_of"].get(kind)
    return None if e is None else e.t - episode["t"]


def goodput(steps: int, step_time_s: float, wall_s: float) -> float:
    """The share of the wall time the steps would have taken at the fault-free pace:
    steps x step_time_s / wall_s, at most 1 (a stretch of steps quicker than the pace is not
    more than useful work), 0 for no wall time."""
    if wall_s <= 0:
        return 0.0
    return min(1.0, steps * step_time_s / wall_s)


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
        "goodput": goodput(steps, step, wall),
        "restarts": sum(1 for e in events if e.kind == "restart"),
        "faults": faults,
    }

