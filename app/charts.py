"""Chart builders: pure functions from loaded data to Altair charts, shared by the dashboard
and `keel report`, unit-tested through `.to_dict()`. No Streamlit here."""
from __future__ import annotations

import math
from typing import Any, Sequence

import altair as alt

from app import data
from keel.events import Event
from keel import fault_classes
from keel.fault_classes import FAULT_CLASSES
from keel.scenario import Scenario

FAULT_COLOURS = {fc.name: fc.colour for fc in fault_classes.classes()}
STATE_COLOURS = {"launching": "#d9d9d9", "training": "#c7e9c0", "stalled": "#fdae6b", "restarting": "#e6550d",
                 "checkpoint": "#9ecae1", **FAULT_COLOURS}
MARK_SHAPES = {"fault": "cross", "detect": "triangle-down", "recover_start": "diamond",
               "recover_end": "circle", "reslot": "triangle-right", "quarantine": "square",
               "restart": "triangle-up"}
WIDTH = 640
TWIN_COLOUR = "#222222"
REP_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


PAD = alt.AutoSizeParams(type="pad", contains="padding")  # sizes are the plot's; Streamlit would fit legends in


def _scale(mapping: dict[str, str]) -> alt.Scale:
    return alt.Scale(domain=list(mapping), range=list(mapping.values()))


# ----------------------------------------------------------------------------- topology

def topology_frames(scenario: Scenario) -> dict[str, list[dict[str, Any]]]:
    """Positions of regions (on a circle) and their nodes (a ring around each region), and
    the links between regions with their RTT and bandwidth. The spares are the last
    `policy.hot_spares` nodes in scenario order."""
    regions = scenario.regions
    n = len(regions)
    radius = 0.0 if n == 1 else 1.0
    spares = set(scenario.node_names[len(scenario.node_names) - scenario.policy.hot_spares:]) \
        if scenario.policy.hot_spares else set()
    centre: dict[str, tuple[float, float]] = {}
    region_rows, node_rows, link_rows = [], [], []
    ring = 0.18 if n > 1 else 0.6
    for i, r in enumerate(regions):
        a = math.pi / 2 - 2 * math.pi * i / max(n, 1)
        cx, cy = radius * math.cos(a), radius * math.sin(a)
        centre[r.name] = (cx, cy)
        region_rows.append({"region": r.name, "x": cx, "y": cy, "nodes": r.nodes,
                            "gpus": r.nodes * r.gpus_per_node, "intra_gbit_s": r.intra_gbit_s,
                            "label": f"{r.name} ({r.nodes} x {r.gpus_per_node} GPU)"})
        for j in range(r.nodes):
            b = 2 * math.pi * j / r.nodes
            name = f"{r.name}/{j}"
            node_rows.append({"node": name, "region": r.name,
                              "x": cx + ring * math.cos(b), "y": cy + ring * math.sin(b),
                              "role": "hot spare" if name in spares else "training"})
    # Each link's label sits on the link, halfway where it can: the first spot along it whose
    # box (estimated in the chart's units) overlaps no label placed before it, no region's
    # label and no region's ring of nodes.
    taken = [_box(r["x"], r["y"] + REGION_LABEL_DY, len(r["label"]), bold=True) for r in region_rows]
    taken += [(cx - ring, cy - ring, cx + ring, cy + ring) for cx, cy in centre.values()]
    segments = [(centre[link.a], centre[link.b]) for link in scenario.links]
    taken += [(x - 0.06, y - 0.06, x + 0.06, y + 0.06) for i, s1 in enumerate(segments) for s2 in segments[i + 1:]
              for x, y in [_crossing(s1, s2)] if x is not None]  # where two links cross, no label
    for link in scenario.links:
        (ax, ay), (bx, by) = centre[link.a], centre[link.b]
        label = f"{link.rtt_ms:g} ms, {link.gbit_s:g} Gbit/s"
        # along the link first, then just above or below it
        line_h = _box(0, 0, 1)[3] * 2.2
        spots = [(ax + (bx - ax) * t, ay + (by - ay) * t + dy) for dy in (0.0, line_h, -line_h) for t in LABEL_SPOTS]
        boxes = [_box(x, y, len(label)) for x, y in spots]
        k = next((i for i, b in enumerate(boxes) if not any(_overlap(b, o) for o in taken)), 0)
        taken.append(boxes[k])
        link_rows.append({"a": link.a, "b": link.b, "x": ax, "y": ay, "x2": bx, "y2": by,
                          "mx": spots[k][0], "my": spots[k][1],
                          "rtt_ms": link.rtt_ms, "gbit_s": link.gbit_s, "jitter_ms": link.jitter_ms,
                          "label": label})
    return {"regions": region_rows, "nodes": node_rows, "links": link_rows}


# the topology chart's geometry: its domains and size, and what a label's box takes
TOPO_X, TOPO_Y, TOPO_W, TOPO_H = (-1.45, 1.45), (-1.4, 1.45), 520, 440
LABEL_SPOTS = (0.5, 0.4, 0.6, 0.33, 0.67, 0.27, 0.73, 0.45, 0.55, 0.22, 0.78)
REGION_LABEL_DY = 48 * (TOPO_Y[1] - TOPO_Y[0]) / TOPO_H  # the region label's dy, in y units


def _box(x: float, y: float, chars: int, bold: bool = False) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of a text label centred on (x, y), in the chart's units: about 5.6
    px a character at font size 10 (7.4 bold at 12), 13 px high."""
    w = (chars + 2) * (7.4 if bold else 5.6) * (TOPO_X[1] - TOPO_X[0]) / TOPO_W  # a character's room each side
    h = (15 if bold else 13) * (TOPO_Y[1] - TOPO_Y[0]) / TOPO_H
    return (x - w / 2, y - h / 2, x + w / 2, y + h / 2)


def _crossing(s1: tuple, s2: tuple) -> tuple[float | None, float | None]:
    """Where two segments ((x, y), (x, y)) cross inside both (not at a shared end), or (None, None)."""
    (x1, y1), (x2, y2) = s1
    (x3, y3), (x4, y4) = s2
    d = (x2 - x1) * (y4 - y3) - (y2 - y1) * (x4 - x3)
    if abs(d) < 1e-12:
        return None, None
    t = ((x3 - x1) * (y4 - y3) - (y3 - y1) * (x4 - x3)) / d
    u = ((x3 - x1) * (y2 - y1) - (y3 - y1) * (x2 - x1)) / d
    if 1e-6 < t < 1 - 1e-6 and 1e-6 < u < 1 - 1e-6:
        return x1 + t * (x2 - x1), y1 + t * (y2 - y1)
    return None, None


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def topology_chart(scenario: Scenario) -> alt.LayerChart:
    """The cluster as a graph: regions on a circle, each region's nodes around it (hot
    spares hollow), links between regions labelled with RTT and bandwidth."""
    f = topology_frames(scenario)
    axis = alt.Axis(title=None, labels=False, ticks=False, grid=False, domain=False)
    x = alt.X("x:Q", axis=axis, scale=alt.Scale(domain=list(TOPO_X)))
    y = alt.Y("y:Q", axis=axis, scale=alt.Scale(domain=list(TOPO_Y)))
    links = alt.Chart(alt.Data(values=f["links"])).mark_rule(color="#888", strokeWidth=2).encode(
        x=x, y=y, x2="x2:Q", y2="y2:Q",
        tooltip=["a:N", "b:N", alt.Tooltip("rtt_ms:Q", title="RTT (ms)"),
                 alt.Tooltip("gbit_s:Q", title="Gbit/s"), alt.Tooltip("jitter_ms:Q", title="jitter (ms)")])
    label_enc = dict(x=alt.X("mx:Q", axis=axis), y=alt.Y("my:Q", axis=axis), text="label:N")
    halo = alt.Chart(alt.Data(values=f["links"])).mark_text(fontSize=10, stroke="white", strokeWidth=4,
                                                            color="white").encode(**label_enc)
    link_labels = alt.Chart(alt.Data(values=f["links"])).mark_text(fontSize=10, color="#333").encode(**label_enc)
    nodes = alt.Chart(alt.Data(values=f["nodes"])).mark_point(size=70, filled=True).encode(
        x=x, y=y,
        color=alt.Color("region:N", scale=alt.Scale(scheme="tableau10"), legend=alt.Legend(title="region", orient="bottom")),
        shape=alt.Shape("role:N", scale=alt.Scale(domain=["training", "hot spare"], range=["circle", "diamond"]),
                        legend=alt.Legend(title="node", orient="bottom")),
        tooltip=["node:N", "region:N", "role:N"])
    region_labels = alt.Chart(alt.Data(values=f["regions"])).mark_text(fontSize=12, fontWeight="bold", dy=-48, color="#222").encode(
        x=x, y=y, text="label:N",
        tooltip=["region:N", "nodes:Q", "gpus:Q", alt.Tooltip("intra_gbit_s:Q", title="intra Gbit/s")])
    return alt.layer(links, halo, link_labels, nodes, region_labels).properties(
        autosize=PAD, width=TOPO_W, height=TOPO_H, title=f"{scenario.run.name}: {scenario.total_nodes} nodes in {len(scenario.regions)} regions")


# ----------------------------------------------------------------------------- timelines

def timeline_chart(events: Sequence[Event], summary: dict[str, Any] | None = None,
                   title: str = "timeline", x_domain: Sequence[float] | None = None,
                   offset: float = 0.0, x_title: str = "time since run start (s)") -> alt.LayerChart:
    """A Gantt of the run: the run lane (training, stalled after a fault, restarting),
    checkpoints, and one lane per fault target with its episode as a bar; faults, detection,
    recovery, re-slotting and restarts marked. `offset`: see `data.timeline`."""
    tl = data.timeline(events, summary, offset)
    lanes = tl["lanes"] + ([data.CHECKPOINT_LANE] if any(b["lane"] == data.CHECKPOINT_LANE for b in tl["bars"])
                           and data.CHECKPOINT_LANE not in tl["lanes"] else [])
    xscale = alt.Scale(domain=list(x_domain)) if x_domain else alt.Undefined
    y = alt.Y("lane:N", sort=lanes, title=None, scale=alt.Scale(domain=lanes))
    bars = alt.Chart(alt.Data(values=tl["bars"])).mark_bar(height={"band": 0.7}, cornerRadius=2).encode(
        x=alt.X("start:Q", title=x_title, scale=xscale), x2="end:Q", y=y,
        color=alt.Color("state:N", scale=_scale(STATE_COLOURS),
                        legend=alt.Legend(title="state", orient="bottom", direction="horizontal", columns=4)),
        tooltip=["label:N", alt.Tooltip("start:Q", format=".3f"), alt.Tooltip("end:Q", format=".3f")])
    marks = alt.Chart(alt.Data(values=tl["marks"] or [{"lane": data.RUN_LANE, "t": 0.0, "kind": "fault"}]),
                      ).mark_point(size=80, filled=True, color="black", opacity=1 if tl["marks"] else 0).encode(
        x=alt.X("t:Q", scale=xscale), y=y,
        shape=alt.Shape("kind:N", scale=_scale(MARK_SHAPES),
                        legend=alt.Legend(title="event", orient="bottom", direction="horizontal", columns=3)),
        tooltip=["kind:N", alt.Tooltip("t:Q", format=".3f"), "step:Q", "fault_id:Q", "class:N", "target:N", "action:N"])
    return alt.layer(bars, marks).properties(autosize=PAD, width=WIDTH, height=max(60, 28 * len(lanes)), title=title)


def aligned_timelines(runs: dict[str, tuple[Sequence[Event], dict[str, Any]]],
                      offsets: dict[str, float] | None = None) -> alt.VConcatChart:
    """Timelines one above the other on one time axis (twin above the runtime's
    repetitions), for seeing predicted and observed recovery line up. `offsets` shifts a
    run so that its training starts at 0 (the runtime's launch, from comparison.json)."""
    offsets = offsets or {}
    ends = [max((e.t for e in ev), default=0.0) - offsets.get(label, 0.0) for label, (ev, _) in runs.items()]
    domain = [-max(offsets.values(), default=0.0), max(ends, default=1.0) or 1.0]
    x_title = "time since training start (s)" if offsets else "time since run start (s)"
    charts = [timeline_chart(ev, s, title=label + (f" (launch {offsets[label]:.3g} s before 0)" if label in offsets else ""),
                             x_domain=domain, offset=offsets.get(label, 0.0), x_title=x_title)
              for label, (ev, s) in runs.items()]
    for chart in charts:
        chart.autosize = alt.Undefined  # set once, on the concatenation
    return alt.vconcat(*charts, autosize=PAD).resolve_scale(x="shared", color="shared", shape="shared")


def progress_chart(runs: dict[str, Sequence[Event]], offsets: dict[str, float] | None = None) -> alt.Chart:
    """Steps committed against time, one line per run: flat stretches are downtime.
    `offsets` as for `aligned_timelines`."""
    offsets = offsets or {}
    rows = [dict(p, run=label, source="predicted (twin)" if label == "twin" else "observed (runtime)")
            for label, ev in runs.items() for p in data.progress(ev, offset=offsets.get(label, 0.0))]
    labels = list(runs)
    colour = alt.Color("run:N", title="run", legend=alt.Legend(orient="bottom"),
                       scale=alt.Scale(scheme="tableau10") if "twin" not in labels else
                       alt.Scale(domain=labels, range=[TWIN_COLOUR if k == "twin" else REP_COLOURS[i % len(REP_COLOURS)]
                                                       for i, k in enumerate(labels)]))
    encoding = dict(
        x=alt.X("t:Q", title="time since training start (s)" if offsets else "time since run start (s)"),
        y=alt.Y("step:Q", title="steps committed"), color=colour, tooltip=["run:N", "t:Q", "step:Q"])
    if "twin" in labels:  # a validation: the prediction drawn apart from what was observed
        encoding["strokeDash"] = alt.StrokeDash("source:N", title=None, legend=alt.Legend(orient="bottom"), scale=alt.Scale(
            domain=["predicted (twin)", "observed (runtime)"], range=[[6, 3], [1, 0]]))
        encoding["size"] = alt.Size("source:N", legend=None, scale=alt.Scale(
            domain=["predicted (twin)", "observed (runtime)"], range=[3, 1.5]))
    # linear, not a staircase: the twin samples its step events
    return alt.Chart(alt.Data(values=rows)).mark_line().encode(**encoding).properties(
        autosize=PAD, width=WIDTH, height=220, title=alt.TitleParams("progress", subtitle="steps committed over time: a flat stretch is downtime",
                                                      subtitleColor="#555", anchor="start"))


# ----------------------------------------------------------------------------- per run

def downtime_chart(summaries: dict[str, dict[str, Any]]) -> alt.Chart:
    """Downtime per fault, one bar group per fault, one bar per run (policies side by side)."""
    rows = [{"run": label, "fault": f"{f['fault_id']}: {f['class']}", "class": f["class"],
             "downtime_s": f["downtime_s"], "cost_s": f.get("cost_s"), "target": f.get("target"),
             "action": f.get("action")}
            for label, s in summaries.items() for f in s.get("faults", [])]
    return alt.Chart(alt.Data(values=rows)).mark_bar().encode(
        x=alt.X("fault:N", title="fault", sort=None, axis=alt.Axis(labelLimit=0, labelAngle=-40, labelOverlap=False)), xOffset="run:N",
        y=alt.Y("downtime_s:Q", title="downtime (s)"),
        color=alt.Color("run:N", scale=alt.Scale(scheme="tableau10"), legend=alt.Legend(title=None, orient="bottom", labelLimit=0)),
        tooltip=["run:N", "fault:N", "target:N", "action:N", alt.Tooltip("downtime_s:Q", format=".3f"),
                 alt.Tooltip("cost_s:Q", format=".3f")],
    ).properties(autosize=PAD, width=420, height=240, title="downtime per fault")


def loss_chart(summary: dict[str, Any], title: str = "training loss") -> alt.Chart:
    """A runtime run's loss at every committed step (its summary's `losses`, from `start_step`)."""
    start = int(summary.get("start_step") or 0)
    rows = [{"step": start + i + 1, "loss": x} for i, x in enumerate(summary.get("losses") or [])]
    return alt.Chart(alt.Data(values=rows)).mark_line(point=len(rows) <= 60).encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("loss:Q", title="loss", scale=alt.Scale(zero=False)),
        tooltip=["step:Q", alt.Tooltip("loss:Q", format=".4f")],
    ).properties(autosize=PAD, width=420, height=200, title=title)


def goodput_chart(summaries: dict[str, dict[str, Any]]) -> alt.LayerChart:
    """Goodput per run (policies side by side), with the 95% interval when replicated."""
    rows = []
    for label, s in summaries.items():
        ci = s.get("goodput_ci95") or [s.get("goodput"), s.get("goodput")]
        rows.append({"run": label, "goodput": s.get("goodput"), "lo": ci[0], "hi": ci[1],
                     "restarts": s.get("restarts")})
    base = alt.Chart(alt.Data(values=rows))
    x = alt.X("goodput:Q", scale=alt.Scale(domain=[0, 1]), title="goodput (95% interval where replicated)")
    bars = base.mark_bar().encode(
        y=alt.Y("run:N", title=None, sort=None, axis=alt.Axis(labelLimit=0)), x=x,
        color=alt.Color("run:N", legend=None, scale=alt.Scale(scheme="tableau10")),
        tooltip=["run:N", alt.Tooltip("goodput:Q", format=".4f"), "restarts:Q"])
    err = base.mark_rule(color="black", strokeWidth=2).encode(
        y=alt.Y("run:N", sort=None), x=alt.X("lo:Q", title=None), x2="hi:Q")
    text = base.mark_text(align="right", dx=-6, color="white", fontWeight="bold").encode(
        y=alt.Y("run:N", sort=None), x=x, text=alt.Text("goodput:Q", format=".4f"))
    return alt.layer(bars, err, text).properties(autosize=PAD, width=360, height=40 + 30 * len(rows), title="goodput")


# ----------------------------------------------------------------------------- plan

def _zoom(values: Sequence[float], pad: float = 0.08) -> list[float]:
    lo, hi = min(values), max(values)
    span = (hi - lo) or abs(hi) * 0.01 or 1e-6
    return [lo - pad * span, hi + pad * span]


def pareto_chart(plan: dict[str, Any]) -> alt.LayerChart:
    """Every candidate as goodput against cost, the Pareto front as a line, the recommended
    policy and the baseline marked. The view is zoomed on the front, the recommended and
    the baseline; candidates outside it are counted in the subtitle, not drawn."""
    rows = data.plan_rows(plan)
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["cost_node_hours_per_step"] or 0.0)
    special = []
    for tag in ("recommended", "baseline"):
        entry = plan.get(tag)
        if isinstance(entry, dict) and entry.get("goodput") is not None:
            special.append({"which": tag, "goodput": entry["goodput"],
                            "cost_node_hours_per_step": entry.get("cost_node_hours_per_step"),
                            "policy": data.policy_text(data.policy_of(entry))})
    anchor = [r for r in front + special if r.get("cost_node_hours_per_step") is not None] or rows
    subtitle = ["line: the Pareto front (no candidate is both cheaper and better)"]
    if anchor:
        xdom = _zoom([r["cost_node_hours_per_step"] for r in anchor])
        ydom = _zoom([r["goodput"] for r in anchor])
        inside = [r for r in rows if xdom[0] <= (r["cost_node_hours_per_step"] or 0.0) <= xdom[1]
                  and ydom[0] <= (r["goodput"] or 0.0) <= ydom[1]]
        if len(inside) < len(rows):
            subtitle.append(f"zoomed on the front: {len(rows) - len(inside)} of {len(rows)} candidates lie outside "
                            "this view (all are in the table)")
        rows = inside
        xscale, yscale = alt.Scale(domain=xdom, nice=False), alt.Scale(domain=ydom, nice=False)
    else:
        xscale, yscale = alt.Scale(zero=False), alt.Scale(zero=False)
    x = alt.X("cost_node_hours_per_step:Q", title="cost (node-hours per useful step)", scale=xscale)
    y = alt.Y("goodput:Q", title="goodput", scale=yscale)
    trials = alt.Chart(alt.Data(values=rows)).mark_circle(size=50, opacity=0.6).encode(
        x=x, y=y, color=alt.Color("pareto:N", scale=alt.Scale(domain=[True, False], range=["#1f77b4", "#bbbbbb"]),
                                  legend=alt.Legend(title="on the Pareto front")),
        tooltip=["rank:Q", "number:Q", alt.Tooltip("goodput:Q", format=".4f"),
                 alt.Tooltip("cost_node_hours_per_step:Q", format=".4g"), "policy:N"])
    line = alt.Chart(alt.Data(values=front or [{"goodput": 0, "cost_node_hours_per_step": 0}])).mark_line(
        color="#1f77b4", opacity=1 if front else 0).encode(x=x, y=y)
    marks = alt.Chart(alt.Data(values=special or [{"which": "recommended", "goodput": 0, "cost_node_hours_per_step": 0}]),
                      ).mark_point(size=220, strokeWidth=3, filled=False, opacity=1 if special else 0).encode(
        x=x, y=y, shape=alt.Shape("which:N", scale=alt.Scale(domain=["recommended", "baseline"], range=["diamond", "square"]),
                                  legend=alt.Legend(title="chosen")),
        color=alt.value("#d62728"), tooltip=["which:N", "goodput:Q", "cost_node_hours_per_step:Q", "policy:N"])
    title = alt.TitleParams("recovery policies: goodput against cost", subtitle=subtitle, subtitleColor="#555",
                            anchor="start")
    return alt.layer(line, trials, marks).resolve_scale(color="independent").properties(
        autosize=PAD, width=WIDTH, height=360, title=title)


# ----------------------------------------------------------------------------- compare

def parity_chart(comparison: dict[str, Any]) -> alt.LayerChart:
    """Observed against predicted downtime per fault: each runtime repetition a point, the
    twin's 95% interval a horizontal error bar, the y = x line and the declared tolerance
    band (y within x times 1 +- downtime_rel_tol)."""
    rows = data.parity_rows(comparison)
    tol = float(comparison.get("tolerances", {}).get("downtime_rel_tol") or 0.0)
    values = [r["observed_s"] for r in rows] + [r["predicted_lo"] for r in rows] + [r["predicted_hi"] for r in rows]
    top = max(values + [1e-3]) * 1.15
    low = min(values) * 0.85 if values and min(values) > 0.3 * max(values) else 0.0  # zoom onto the points
    line = [{"x": x, "y": x, "lo": x * (1 - tol), "hi": x * (1 + tol)} for x in (low, top)]
    scale = alt.Scale(domain=[low, top], nice=False, clamp=True)
    x = alt.X("predicted_s:Q", title="predicted downtime (s)", scale=scale)
    y = alt.Y("observed_s:Q", title="observed downtime (s)", scale=scale)
    band = alt.Chart(alt.Data(values=line)).mark_area(opacity=0.18, color="#2ca02c").encode(
        x=alt.X("x:Q", scale=scale), y=alt.Y("lo:Q", scale=scale), y2="hi:Q",
        tooltip=[alt.Tooltip("x:Q", title=f"tolerance +-{tol:.0%}")])
    identity = alt.Chart(alt.Data(values=line)).mark_line(color="#2ca02c", strokeDash=[5, 3]).encode(
        x=alt.X("x:Q", scale=scale), y=alt.Y("y:Q", scale=scale))
    base = alt.Chart(alt.Data(values=rows))
    err = base.mark_rule(strokeWidth=2, opacity=0.7).encode(
        x=alt.X("predicted_lo:Q", scale=scale), x2="predicted_hi:Q", y=y,
        color=alt.Color("class:N", scale=_scale(FAULT_COLOURS)))
    points = base.mark_point(size=70, filled=True).encode(
        x=x, y=y, color=alt.Color("class:N", scale=_scale(FAULT_COLOURS),
                                  legend=alt.Legend(title="fault class", orient="bottom", columns=2)),
        tooltip=["fault_id:Q", "class:N", "target:N", "rep:Q", alt.Tooltip("predicted_s:Q", format=".3f"),
                 alt.Tooltip("predicted_lo:Q", format=".3f"), alt.Tooltip("predicted_hi:Q", format=".3f"),
                 alt.Tooltip("observed_s:Q", format=".3f")])
    ftol = comparison.get("tolerances", {}).get("fault_rel_tol")
    each = f"; each fault may be off by {ftol:.0%}" if ftol is not None and ftol != tol else ""
    title = alt.TitleParams(
        f"observed vs predicted downtime (band: +-{tol:.0%})",
        subtitle=["dot: one runtime repetition of a fault (colour: its class)",
                  "horizontal bar: the twin's 95% interval for that fault",
                  "dashed line: observed = predicted",
                  f"green band: within +-{tol:.0%} (the median's tolerance{each})"],
        subtitleColor="#555", anchor="start")
    return alt.layer(band, identity, err, points).properties(autosize=PAD, width=380, height=380, title=title)


def residual_chart(comparison: dict[str, Any]) -> alt.LayerChart:
    """Relative residual (observed - predicted) / predicted of every repetition, by fault
    class, with zero and the tolerance band."""
    rows = [r for r in data.parity_rows(comparison) if r["rel_residual"] is not None]
    tol = float(comparison.get("tolerances", {}).get("downtime_rel_tol") or 0.0)
    classes = [c for c in FAULT_CLASSES if any(r["class"] == c for r in rows)] or list(FAULT_CLASSES)
    xcls = alt.X("class:N", title="fault class", sort=classes, scale=alt.Scale(domain=classes),
                 axis=alt.Axis(labelAngle=-35, labelOverlap=False, labelLimit=160))
    band = alt.Chart(alt.Data(values=[{"lo": -tol, "hi": tol}])).mark_rect(opacity=0.15, color="#2ca02c").encode(
        y=alt.Y("lo:Q"), y2="hi:Q")
    zero = alt.Chart(alt.Data(values=[{"zero": 0.0}])).mark_rule(color="#2ca02c", strokeDash=[5, 3]).encode(y="zero:Q")
    points = alt.Chart(alt.Data(values=rows)).mark_circle(size=70, opacity=0.8).encode(
        x=xcls, xOffset=alt.XOffset("rep:N"),
        y=alt.Y("rel_residual:Q", title="(observed - predicted) / predicted", axis=alt.Axis(format="%")),
        color=alt.Color("class:N", scale=_scale(FAULT_COLOURS), legend=None),
        tooltip=["fault_id:Q", "target:N", "rep:Q", alt.Tooltip("rel_residual:Q", format=".1%"),
                 alt.Tooltip("residual_s:Q", format=".3f")])
    title = alt.TitleParams("residuals by fault class",
                            subtitle=["dot: one runtime repetition of a fault", "dashed line: no error",
                                      f"green band: within +-{tol:.0%} (the median's tolerance)"],
                            subtitleColor="#555", anchor="start")
    return alt.layer(band, zero, points).properties(autosize=PAD, width=320, height=380, title=title)
