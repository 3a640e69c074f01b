"""Simulate: run the twin on the current scenario (policy A as the scenario has it) and,
side by side on the same fault trace (same seed), a second policy B: by default the
checkpoint-restart baseline, or the one sent from Plan. Or open a run directory."""
import time

import streamlit as st

from app import charts, data, ui
from keel.errors import InputError

ui.entry_guard()

s = st.session_state
BASELINE = ['policy.kind="checkpoint_restart"']

st.title("Simulate")
source = st.radio("source", ["run the twin", "open a run directory"], horizontal=True, key="simulate_source",
                  label_visibility="collapsed")


def show(results: dict) -> None:
    """Results side by side: headline, goodput, downtime per fault, timelines on one time
    axis, progress, a runtime run's job and loss curve, and each run's per-fault table."""
    labels = list(results)
    cols = st.columns(len(labels))
    for col, label in zip(cols, labels):
        h = data.headline(results[label]["summary"])
        with col:
            st.markdown(f"**{label}**")
            if results[label].get("overrides"):
                st.caption(", ".join(results[label]["overrides"]))
            a, b, c = st.columns(3)
            a.metric("goodput", data.fmt(h["goodput"], ".4f"))
            b.metric("wall", ui.seconds(h["wall_s"]))
            c.metric("restarts", h["restarts"])
    summaries = {k: v["summary"] for k, v in results.items()}
    left, right = st.columns(2)
    with left:
        st.altair_chart(charts.goodput_chart(summaries), width="content")
    with right:
        if any(v.get("faults") for v in summaries.values()):
            st.altair_chart(charts.downtime_chart(summaries), width="content")
    st.altair_chart(charts.aligned_timelines({k: (v["events"], v["summary"]) for k, v in results.items()}), width="content")
    st.altair_chart(charts.progress_chart({k: v["events"] for k, v in results.items()}), width="content")
    for label in labels:
        job = data.job_line(results[label]["summary"])
        if job is not None:  # a runtime run: its job and its loss
            st.caption(f"{label}: {job}")
            st.altair_chart(charts.loss_chart(results[label]["summary"], title=f"training loss: {label}"), width="content")
    for label in labels:
        st.markdown(f"**faults: {label}**")
        st.dataframe(data.fault_table(results[label]["summary"]), hide_index=True)


if source == "open a run directory":
    picked = ui.pick_dir("run directory", ["run"], key="simulate_dir")
    if picked is None:
        st.info(f"No run directories under `{ui.runs_root()}`; run the twin here, or `keel simulate SCENARIO --out DIR`.")
        st.stop()
    try:
        events, summary = data.cached_run(picked)
    except InputError as e:
        ui.show_error(e)
        st.stop()
    show({picked.name: {"events": events, "summary": summary}})
    st.stop()

try:
    scenario = ui.current_scenario()
except InputError as e:
    ui.show_error(e)
    st.stop()
st.caption(f"scenario **{scenario.run.name}**: {scenario.total_nodes} nodes, {len(scenario.regions)} regions, "
           f"{scenario.run.steps} steps, policy `{scenario.policy.kind}` with {scenario.policy.hot_spares} hot spares. "
           "Edit it on the Topology page.")

# Widget values live under keys of their own ("simulate_b_text", "simulate_compare_on"), so
# that Plan can set them and they survive a visit to another page; each widget is given its
# value back through its key before it is drawn (never with `value=` as well).
s.setdefault("simulate_b_text", "\n".join(BASELINE))
s.setdefault("simulate_compare_on", True)
for widget, kept in (("simulate_b", "simulate_b_text"), ("simulate_compare", "simulate_compare_on")):
    if widget not in s:
        s[widget] = s[kept]
c1, c2 = st.columns([1, 3])
with c1:
    seed = st.number_input("seed (the fault trace)", value=int(s.get("simulate_seed_value", scenario.run.seed)), step=1,
                           key="simulate_seed")
    s["simulate_seed_value"] = int(seed)
    compare = st.checkbox("compare with policy B", key="simulate_compare")
    s["simulate_compare_on"] = compare
with c2:
    text_b = st.text_area("policy B: `dotted.key=value` lines over the scenario", key="simulate_b",
                          disabled=not compare, height=110)
    s["simulate_b_text"] = text_b
    sent = s.get("policy_b")
    from_plan = bool(sent) and text_b.strip() == "\n".join(data.overrides_of(sent)).strip()
    if from_plan:
        st.caption(f"policy B came from Plan: {s.get('policy_b_label') or 'a trial'}")
overrides_b = [line.strip() for line in text_b.splitlines() if line.strip()]

runs = {"A: " + scenario.policy.kind: []}
if compare:
    try:
        scenario_b = ui.current_scenario(overrides_b)
    except InputError as e:
        ui.show_error(e)
        st.stop()
    label_b = "B: " + (s.get("policy_b_label") if from_plan and s.get("policy_b_label") else scenario_b.policy.kind)
    if label_b in runs:
        label_b += " (B)"
    runs[label_b] = overrides_b

if not ui.twin_available():
    st.warning("The twin (`twin.simulate`) is not part of this checkout yet; open a run directory instead.")
    st.stop()

if st.button("Run the twin", type="primary", key="simulate_run"):
    bar = st.progress(0.0, text="starting")
    results = {}
    for n, (label, overrides) in enumerate(runs.items()):
        bar.progress(n / len(runs), text=f"simulating {label} ({n + 1}/{len(runs)})")
        started = time.monotonic()
        try:
            events, summary = ui.simulate(ui.current_scenario(overrides), seed=int(seed))
        except InputError as e:
            bar.empty()
            ui.show_error(e)
            st.stop()
        results[label] = {"events": events, "summary": summary, "overrides": overrides,
                          "elapsed_s": time.monotonic() - started, "seed": int(seed), "scenario": scenario.run.name}
    bar.progress(1.0, text=f"done: {len(results)} run{'s' * (len(results) != 1)} on seed {int(seed)}")
    s["sim_results"] = results

results = s.get("sim_results") or {}
if not results:
    st.info("Press **Run the twin**: policy A and B run on the same seed, so they meet the same faults.")
    st.stop()
first = next(iter(results.values()))
st.caption(f"{first.get('scenario')} on seed {first.get('seed')}: "
           + ", ".join(f"{k} in {v.get('elapsed_s', 0):.2f} s" for k, v in results.items()))
if len(results) > 1:
    same = data.same_faults_text({k: r["summary"] for k, r in results.items()})
    if same:
        st.caption(same + " A drawn fault strikes at a wall-clock time, so a slower policy meets it at an "
                   "earlier step.")
    else:
        st.warning("The policies met different faults on this seed: a policy that runs longer meets drawn "
                   "faults the other finished before; the scheduled ones are the same.")
show(results)

with st.expander("save these runs"):
    folder = st.text_input("under", value=str(ui.runs_root() / f"{first.get('scenario')}-seed{first.get('seed')}"),
                           key="simulate_save_dir")
    if st.button("Save", key="simulate_save"):
        from pathlib import Path
        for n, (label, r) in enumerate(results.items()):
            ui.save_run(r["events"], r["summary"], Path(folder) / ("ab"[n] if n < 2 else str(n)))
        st.success(f"saved under {folder} (a/ and b/: events.jsonl, summary.json)")
