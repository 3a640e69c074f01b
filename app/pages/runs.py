"""Runs: what is under the runs directory; with nothing there, the default scenario and a
button that runs the twin on it."""
import streamlit as st

from app import charts, data, ui
from keel.errors import InputError
from keel.paths import DEFAULT_SCENARIO

ui.entry_guard()

st.title("keel")
st.caption("Digital twin, planner and resilient runtime for multi-region training.")
root = ui.runs_root()
runs = data.list_runs(root)

if not runs:
    st.info(f"No runs under `{root}` yet. Start with the default scenario: the twin predicts it in seconds.")
    try:
        default = ui.current_scenario() if st.session_state["scenario_path"] == str(DEFAULT_SCENARIO) else None
        if default is None:
            from keel import scenario as sc
            default = sc.load(DEFAULT_SCENARIO)
    except InputError as e:
        ui.show_error(e)
        st.stop()
    st.subheader(f"{default.run.name}: {default.total_nodes} nodes, {len(default.regions)} regions, "
                 f"{sum(r.nodes * r.gpus_per_node for r in default.regions)} GPUs")
    st.altair_chart(charts.topology_chart(default), width="content")
    if not ui.twin_available():
        st.warning("The twin (`twin.simulate`) is not part of this checkout yet.")
    elif st.button(f"Run the twin on {default.run.name}", type="primary", key="run_default"):
        out = root / default.run.name
        with st.status(f"twin: simulating {default.run.name} ({default.run.steps} steps)", expanded=False) as status:
            try:
                events, summary = ui.simulate(default)
                ui.save_run(events, summary, out)
            except InputError as e:
                status.update(label="the twin refused the scenario", state="error")
                ui.show_error(e)
                st.stop()
            status.update(label=f"wrote {out}", state="complete")
        st.rerun()
    st.stop()

jobs = [r for r in runs if r.is_job]
st.subheader(f"Runs under `{root}`")
st.caption(f"{len(jobs)} job{'s' * (len(jobs) != 1)}, newest first; the runs a job is made of "
           "(a validation's twin and runtime repetitions) are listed under it.")
st.dataframe(data.runs_table(runs), hide_index=True, column_config={"path": st.column_config.TextColumn(width="large")})
latest = next((r for r in jobs if r.kind == "run"), None)
if latest is not None:
    try:
        events, summary = data.cached_run(latest.path)
    except InputError as e:
        ui.show_error(e)
        st.stop()
    st.subheader(f"Latest run: {latest.label}")
    cols = st.columns(4)
    h = data.headline(summary)
    cols[0].metric("goodput", data.fmt(h["goodput"], ".3f"))
    cols[1].metric("wall time", ui.seconds(h["wall_s"]))
    cols[2].metric("faults", h["faults"])
    cols[3].metric("restarts", data.fmt(h["restarts"], "d"))
    st.altair_chart(charts.timeline_chart(events, summary, title=latest.label), width="content")
    job = data.job_line(summary)
    if job is not None:  # a runtime run: its job and its loss
        st.caption(job)
        st.altair_chart(charts.loss_chart(summary), width="content")
latest_validation = next((r for r in jobs if r.kind == "validation"), None)
if latest_validation is not None:
    try:
        comparison = data.cached_comparison(latest_validation.path)
    except InputError as e:
        ui.show_error(e)
    else:
        st.subheader(f"Latest validation: {latest_validation.label}")
        verdict = comparison.get("pass", {})
        cols = st.columns(4)
        median = comparison.get("downtime_median_rel_err")
        cols[0].metric("downtime: median rel. error", "n/a" if median is None else f"{median:.1%}")
        wall = (comparison.get("wall_s") or {}).get("rel_err")
        cols[1].metric("wall time: rel. error", "n/a" if wall is None else f"{wall:.1%}")
        cols[2].metric("faults compared", len(comparison.get("faults", [])))
        cols[3].metric("verdict", {True: "pass", False: "fail", None: "n/a"}[verdict.get("all")])
latest_plan = next((r for r in jobs if r.kind == "plan"), None)
if latest_plan is not None:
    try:
        plan = data.cached_plan(latest_plan.path)
    except InputError as e:
        ui.show_error(e)
    else:
        st.subheader(f"Latest plan: {latest_plan.label}")
        cols = st.columns(4)
        rec, base = plan.get("recommended") or {}, plan.get("baseline") or {}
        cols[0].metric("candidates", len(plan.get("trials", [])))
        cols[1].metric("recommended goodput", data.fmt(rec.get("goodput"), ".4f"))
        cols[2].metric("baseline goodput", data.fmt(base.get("goodput"), ".4f"))
        cols[3].metric("cost against the baseline",
                       data.fmt((plan.get("improvement") or {}).get("cost_ratio"), "+.1%", minus=1.0))
kinds = {r.kind for r in runs}
st.caption("Open " + ", ".join(p for k, p in (("run", "**Simulate** for runs"), ("validation", "**Compare** for validations"),
                                                ("plan", "**Plan** for plans")) if k in kinds)
           + "; `keel report DIR` writes any of them as one HTML file.")
