"""Table shaping and timelines for the dashboard and the report: plain functions over the
files the twin, the runtime and the planner write (layouts in docs/design.md). Nothing here
computes a metric: those come from `summary.json`, `comparison.json` or `keel.metrics`.
Finding runs is app/rundirs.py, reading them (as untrusted input) app/loaders.py, the
Topology page's edits app/topology_edits.py; their names are importable from here too.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

from app.loaders import (cached_comparison, cached_plan, cached_run, load_comparison, load_plan,  # noqa: F401
                         load_run, read_json)
from app.rundirs import (RUN_KINDS, RunDir, checkpoint_runs, dir_kind, jobs_first, list_checkpoints,  # noqa: F401
                         list_runs, mtime, runs_root, runs_table, validation_runs)
from app.topology_edits import (add_link, add_region, edit_overrides, remove_link, remove_region,  # noqa: F401
                                structure_changes)
from keel import metrics
from keel.events import Event
from keel.scenario import override_text

# Lanes that are not a node, a region or a shard; they sort first on a timeline.
RUN_LANE = "run"
CHECKPOINT_LANE = "checkpoints"


# ----------------------------------------------------------------------------- files

def launch_offsets(comparison: dict[str, Any], labels: Sequence[str]) -> dict[str, float]:
    """{'rep-K': the runtime's launch time} from comparison.json (`wall_s.launch_s_reps`,
    where the validation measured it), so timelines line up on the start of training."""
    reps = (comparison.get("wall_s") or {}).get("launch_s_reps") or []
    out = {}
    for label in labels:
        k = label[4:]
        if label.startswith("rep-") and k.isdigit() and int(k) < len(reps) and reps[int(k)]:
            out[label] = float(reps[int(k)])
    return out


def human_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return ""


def checkpoint_rows(infos: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per checkpoint from `keel.ckpt_reader.inspect`: verified or not, and why not."""
    return [{"checkpoint": Path(p).name, "step": i.get("step"), "verified": bool(i.get("ok")),
             "size": human_bytes(i.get("bytes")), "bytes": i.get("bytes"),
             "why refused": "; ".join(i.get("problems") or [])} for p, i in infos.items()]


# ----------------------------------------------------------------------------- tables

MISSING = "\u2013"  # an en dash: what a table shows where a figure does not apply
NON_FINITE = {"nan": "NaN", "inf": "inf", "-inf": "-inf"}


def fmt(x: Any, spec: str = ".4g", minus: float = 0.0, suffix: str = "") -> str:
    """A figure for a tile or a table cell; MISSING for None, never 'None'; a number that is
    not finite as what it is (NaN, inf, -inf)."""
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
        return MISSING
    if isinstance(x, float) and not math.isfinite(x):
        return NON_FINITE.get(str(x), str(x))
    if spec.endswith("d") and not float(x).is_integer():
        spec = ".3g"  # a count averaged over replicas
    elif spec.endswith("d"):
        x = int(x)
    return format(x - minus if minus else x, spec) + suffix


def verdict_text(passed: bool | None) -> str:
    return {True: "pass", False: "fail"}.get(passed, "not judged")


FAULT_COLUMNS = ("fault_id", "class", "target", "action", "at_step", "t", "downtime_s", "cost_s", "lost_steps")


def fault_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """summary.json's per-fault table, in a fixed column order."""
    return [{k: f.get(k) for k in FAULT_COLUMNS} for f in summary.get("faults", [])]


def fault_table(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-fault table for display: units in the headers, no empty figure shown as None."""
    return [{"fault": f.get("fault_id"), "class": f.get("class") or MISSING, "target": f.get("target") or MISSING,
             "action": f.get("action") or MISSING, "at step": fmt(f.get("at_step"), "d"),
             "time (s)": fmt(f.get("t"), ".1f"), "downtime (s)": fmt(f.get("downtime_s"), ".3f"),
             "cost (s)": fmt(f.get("cost_s"), ".3f"), "lost steps": fmt(f.get("lost_steps"), "d")}
            for f in summary.get("faults", [])]


def fault_trace(summary: dict[str, Any]) -> list[tuple[Any, str, str]]:
    """(fault_id, class, target) of each fault: what two policies on one seed share. The
    step a fault strikes at is not part of it: a drawn fault falls at a wall-clock time,
    which a policy that runs faster or slower reaches at another step."""
    return [(f.get("fault_id"), f.get("class"), f.get("target")) for f in summary.get("faults", [])]


def same_faults_text(summaries: dict[str, dict[str, Any]], limit: int = 6) -> str | None:
    """'Both policies met the same 4 faults: ...' (each with its step per policy where they
    differ), or None where the traces differ."""
    traces = [fault_trace(s) for s in summaries.values()]
    if len(traces) < 2 or any(t != traces[0] for t in traces):
        return None
    steps = [[f.get("at_step") for f in s.get("faults", [])] for s in summaries.values()]
    labels = [label.split(":")[0] for label in summaries]
    items = []
    for i, (_, cls, target) in enumerate(traces[0][:limit]):
        at = [st[i] for st in steps]
        when = (f"at step {at[0]}" if len(set(at)) == 1
                else "at steps " + " / ".join(f"{a} ({lab})" for a, lab in zip(at, labels)))
        items.append(f"{cls} on {target} {when}")
    n = len(traces[0])
    who = "Both policies" if len(traces) == 2 else "All runs"
    return (f"{who} met the same {n} fault{'s' * (n != 1)}: " + "; ".join(items)
            + (" ..." if n > limit else "") + ".")


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    return {"goodput": summary.get("goodput"), "wall_s": summary.get("wall_s"),
            "steps": summary.get("steps"), "restarts": summary.get("restarts"),
            "faults": len(summary.get("faults", []))}


def job_line(summary: dict[str, Any]) -> str | None:
    """"job ENTRY (k=v, ...), N parameters" for a runtime run's summary; None for a twin's
    or a summary from before the job API."""
    job = summary.get("job")
    if not isinstance(job, dict) or not isinstance(job.get("entry"), str):
        return None
    config = job.get("config") if isinstance(job.get("config"), dict) else {}
    text = f"job {job['entry']}"
    if config:
        items = ", ".join(f"{k}={v}" for k, v in list(config.items())[:8])
        text += f" ({items}{', ...' if len(config) > 8 else ''})"
    if isinstance(job.get("params"), int):
        text += f", {job['params']:,} parameters"
    return text


def comparison_rows(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """The error table: one row per fault, then the median over faults, wall time, goodput and
    the emulation's faithfulness, each with the declared tolerance and pass/fail, and what its
    error compares (`error of`). Per-fault rows are judged against `fault_rel_tol` (every
    fault's tolerance; comparisons that predate it: the downtime tolerance), the median row
    against `downtime_rel_tol`."""
    tol = comparison.get("tolerances", {})
    dtol = tol.get("downtime_rel_tol")
    ftol = tol.get("fault_rel_tol", dtol)
    rows = []
    for f in comparison.get("faults", []):
        err = f.get("downtime_rel_err")
        rows.append({
            "row": f"fault {f.get('fault_id')}", "class": f.get("class"), "target": f.get("target"),
            "predicted": f.get("predicted", {}).get("downtime_s"),
            "observed": f.get("observed", {}).get("downtime_s"),
            "rel_err": err, "error of": "the medians over repetitions", "tolerance": ftol,
            "pass": None if err is None or ftol is None else abs(err) <= ftol,
        })
    passed = comparison.get("pass", {})
    if comparison.get("downtime_median_rel_err") is not None:
        rows.append({"row": "downtime (median)", "class": None, "target": None, "predicted": None,
                     "observed": None, "rel_err": comparison["downtime_median_rel_err"],
                     "error of": "the median over faults", "tolerance": dtol, "pass": passed.get("downtime")})
    wall = comparison.get("wall_s")
    if wall:
        rows.append({"row": "wall_s", "class": None, "target": None, "predicted": wall.get("predicted"),
                     "observed": wall.get("observed"), "rel_err": wall.get("rel_err"),
                     "error of": "the twin's mean against the repetitions' median",
                     "tolerance": tol.get("wall_rel_tol"), "pass": passed.get("wall")})
    good = comparison.get("goodput")
    if good:
        rows.append({"row": "goodput", "class": None, "target": None, "predicted": good.get("predicted"),
                     "observed": good.get("observed"), "rel_err": good.get("rel_err"),
                     "error of": "the medians over repetitions", "tolerance": None, "pass": None})
    emu = [e for e in comparison.get("emulation") or [] if e]
    if emu:
        late, reports = sum(e.get("overruns", 0) for e in emu), sum(e.get("reports", 0) for e in emu)
        rows.append({"row": "emulation", "class": None, "target": None, "predicted": None, "observed": None,
                     "rel_err": late / reports if reports else None,
                     "error of": f"late step reports ({late} of {reports}): the emulation kept its time",
                     "tolerance": emu[0].get("max_overrun_fraction"), "pass": passed.get("valid")})
    return rows


_ROW_NAMES = {"wall_s": "wall time (s)", "goodput": "goodput (fraction)", "downtime (median)": "downtime, median over faults",
              "emulation": "emulation: late step reports"}


def comparison_table(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """`comparison_rows` for display (the dashboard and the report): the unit of each row's
    figures in its name, errors and tolerances in %, a pass column (pass, fail, or not
    judged where no tolerance is declared), and no empty cell shown as None."""
    out = []
    for r in comparison_rows(comparison):
        name = r["row"]
        if name.startswith("fault "):
            name = f"{name}: downtime (s)"
        goodput = r["row"] == "goodput"
        spec = ".3f" if goodput else ".2f"
        out.append({"row": _ROW_NAMES.get(name, name), "class": r["class"] or MISSING, "target": r["target"] or MISSING,
                    "predicted": fmt(r["predicted"], spec), "observed": fmt(r["observed"], spec),
                    "error (%)": fmt(None if r["rel_err"] is None else 100 * r["rel_err"], ".1f"),
                    "tolerance (%)": MISSING if r["tolerance"] is None else f"{100 * r['tolerance']:g}",
                    "pass": verdict_text(r["pass"]), "error of": r["error of"]})
    return out


def parity_rows(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (fault, repetition): predicted downtime with the twin's interval and the
    observed downtime of that repetition. Falls back to the observed mean when there are no
    per-repetition figures."""
    rows = []
    for f in comparison.get("faults", []):
        pred = f.get("predicted", {})
        obs = f.get("observed", {})
        if pred.get("downtime_s") is None:
            continue
        lo, hi = (pred.get("downtime_ci95") or [pred["downtime_s"], pred["downtime_s"]])[:2]
        reps = obs.get("downtime_s_reps") or ([obs["downtime_s"]] if obs.get("downtime_s") is not None else [])
        for k, value in enumerate(reps):
            if value is None:
                continue
            rows.append({"fault_id": f.get("fault_id"), "class": f.get("class"), "target": f.get("target"),
                         "rep": k, "predicted_s": pred["downtime_s"], "predicted_lo": lo, "predicted_hi": hi,
                         "observed_s": value,
                         "residual_s": value - pred["downtime_s"],
                         "rel_residual": (value - pred["downtime_s"]) / pred["downtime_s"] if pred["downtime_s"] else None})
    return rows


def plan_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranked table: candidates by goodput (desc) then cost (asc), flagged pareto /
    recommended / baseline. The recommended and the baseline are found by their `number`
    (plans written before they carried one: the first candidate with the same policy)."""
    trials = [t for t in plan.get("trials", []) if isinstance(t, dict)]
    pareto_numbers = {p.get("number") for p in plan.get("pareto", []) if isinstance(p, dict)}
    chosen: dict[str, Any] = {}
    for tag in ("recommended", "baseline"):
        entry = plan.get(tag) or {}
        if entry.get("number") is not None:
            chosen[tag] = entry["number"]
        else:
            policy = policy_of(entry)
            chosen[tag] = next((t.get("number") for t in trials if policy and t.get("policy") == policy), None)
    rows = []
    for t in trials:
        ci = t.get("goodput_ci95") or [None, None]
        rows.append({
            "number": t.get("number"), "goodput": t.get("goodput"),
            "goodput_lo": ci[0], "goodput_hi": ci[1],
            "cost_node_hours_per_step": t.get("cost_node_hours_per_step"),
            "pareto": t.get("number") in pareto_numbers,
            "recommended": t.get("number") == chosen["recommended"],
            "baseline": t.get("number") == chosen["baseline"],
            "source": t.get("source") or MISSING,
            "policy": policy_text(t.get("policy", {})),
        })
    rows.sort(key=lambda r: (-(r["goodput"] or 0.0), r["cost_node_hours_per_step"] or 0.0, r["number"] or 0))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    return rows


def plan_table(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """`plan_rows` for display: units in the headers, no None."""
    return [{"rank": r["rank"], "#": r["number"], "goodput": fmt(r["goodput"], ".4f"),
             "goodput 95% interval": (f"{r['goodput_lo']:.4f} - {r['goodput_hi']:.4f}"
                                      if r["goodput_lo"] is not None and r["goodput_hi"] is not None else MISSING),
             "cost (node-h / useful step)": fmt(r["cost_node_hours_per_step"], ".5f"),
             "Pareto front": r["pareto"], "recommended": r["recommended"], "baseline": r["baseline"],
             "source": r["source"], "policy": r["policy"] or "(the scenario's own)"} for r in plan_rows(plan)]


def plan_counts(plan: dict[str, Any]) -> str:
    """How many candidates and where they came from, as `keel plan` prints it."""
    from planner.search import counts_text
    return counts_text(plan)


def policy_of(entry: dict[str, Any]) -> dict[str, Any]:
    """The dotted `--set` keys of a plan entry: a trial's `policy`, or the dotted keys that
    `recommended` / `baseline` carry flat beside their figures."""
    if isinstance(entry.get("policy"), dict):
        return dict(entry["policy"])
    return {k: v for k, v in entry.items() if "." in k and v is not None and not isinstance(v, (dict, list))}


def policy_text(policy: dict[str, Any]) -> str:
    return ", ".join(override_text(k, v) for k, v in sorted(policy.items()))


def overrides_of(policy: dict[str, Any]) -> list[str]:
    """{dotted key: value} -> ['key=value', ...] for `keel.scenario.load(..., overrides)`."""
    return [override_text(k, v) for k, v in policy.items()]




# ----------------------------------------------------------------------------- timelines

def _lane_group(lane: str) -> str:
    if lane in (RUN_LANE, CHECKPOINT_LANE):
        return lane
    return lane.split("/", 1)[0] if "/" in lane else lane


def timeline(events: Sequence[Event], summary: dict[str, Any] | None = None,
             offset: float = 0.0) -> dict[str, list[dict[str, Any]]]:
    """An event log laid out for a Gantt: `bars` (lane, start, end, state) and `marks`
    (lane, t, kind) for faults, detection and recovery. Lanes: the run itself (stalled while
    no step commits after a fault, restarting), checkpoints, and each fault's target (a node
    `region/i`, a region, a shard). Episode bounds come from `keel.metrics`.

    `offset` (seconds) is subtracted from every time: the runtime's launch, which the twin
    does not model, so both start training at 0; the launch then shows as negative time.

    Long on purpose: one pass over the log lays out every lane together (split, it would walk
    the log once per lane)."""
    bars: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []
    if not events:
        return {"bars": bars, "marks": marks, "lanes": []}
    if offset:
        events = [dataclasses.replace(e, t=e.t - offset) for e in events]
        if summary:
            summary = {**summary, "faults": [{**f, "t": f["t"] - offset} if f.get("t") is not None else f
                                             for f in summary.get("faults", [])]}
    summary = summary or metrics.summarize(events)
    start = next((e.t for e in events if e.kind == "run_start"), events[0].t)
    end = next((e.t for e in reversed(events) if e.kind == "run_end"), events[-1].t)
    downtime = {f["fault_id"]: f for f in summary.get("faults", [])}
    lanes: list[str] = [RUN_LANE]

    def lane_of(target: str | None) -> str:
        lane = target or RUN_LANE
        if lane not in lanes:
            lanes.append(lane)
        return lane

    if offset > 0 and start < 0:
        bars.append({"lane": RUN_LANE, "group": RUN_LANE, "start": start, "end": 0.0, "state": "launching",
                     "fault_id": None, "class": None, "label": f"launch: {offset:.3g} s before training starts"})
        start = 0.0
    bars.append({"lane": RUN_LANE, "group": RUN_LANE, "start": start, "end": end, "state": "training",
                 "fault_id": None, "class": None, "label": "training"})
    for ep in metrics.fault_episodes(events):
        fid = ep["fault_id"]
        lane = lane_of(ep["target"])
        ep_end = ep["end_t"]
        stall = downtime.get(fid, {}).get("downtime_s")
        stall_end = ep["t"] + stall if stall is not None else ep_end
        bars.append({"lane": lane, "group": _lane_group(lane), "start": ep["t"], "end": max(ep_end, stall_end),
                     "state": ep["class"], "fault_id": fid, "class": ep["class"],
                     "label": f"fault {fid}: {ep['class']} on {ep['target']} ({ep['action']})"})
        if stall is not None and stall > 0:
            bars.append({"lane": RUN_LANE, "group": RUN_LANE, "start": ep["t"], "end": stall_end,
                         "state": "stalled", "fault_id": fid, "class": ep["class"],
                         "label": f"no step committed for {stall:.3g} s after fault {fid}"})
    open_ckpt: float | None = None
    restart_at: float | None = None
    for e in events:
        if e.kind in metrics.EPISODE_KINDS:
            lane = lane_of(e.target) if e.kind != "restart" else RUN_LANE
            marks.append({"lane": lane, "group": _lane_group(lane), "t": e.t, "kind": e.kind,
                          "step": e.step, "fault_id": e.fault_id, "class": e.fault,
                          "target": e.target, "action": e.action})
        if e.kind == "checkpoint_start":
            open_ckpt = e.t
        elif e.kind == "checkpoint_end":
            if CHECKPOINT_LANE not in lanes:
                lanes.insert(1, CHECKPOINT_LANE)
            t0 = open_ckpt if open_ckpt is not None else e.t
            bars.append({"lane": CHECKPOINT_LANE, "group": CHECKPOINT_LANE, "start": t0, "end": e.t,
                         "state": "checkpoint", "fault_id": None, "class": None,
                         "label": f"checkpoint at step {e.step}"})
            open_ckpt = None
        elif e.kind == "restart":
            restart_at = e.t
        elif e.kind == "step" and restart_at is not None:
            bars.append({"lane": RUN_LANE, "group": RUN_LANE, "start": restart_at, "end": e.t,
                         "state": "restarting", "fault_id": None, "class": None,
                         "label": "checkpoint restart"})
            restart_at = None
    return {"bars": bars, "marks": marks, "lanes": lanes}


def progress(events: Sequence[Event], max_points: int = 400, offset: float = 0.0) -> list[dict[str, Any]]:
    """(t, step) of committed steps, thinned to at most `max_points` (the last one kept);
    `offset` as for `timeline`."""
    pts = [{"t": e.t - offset, "step": e.step} for e in events if e.kind in ("run_start", "step", "run_end")]
    if len(pts) <= max_points:
        return pts
    stride = -(-len(pts) // max_points)
    return pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
