"""Plan: run `keel plan` on the current scenario or open a plan.json; the Pareto front of
goodput against cost, the ranked trials, the recommended policy against the baseline, and
one click that sends a policy to Simulate."""
import subprocess
import sys
from pathlib import Path

import streamlit as st

from app import charts, data, ui
from keel.errors import InputError

ui.entry_guard()

s = st.session_state
st.title("Plan")


def send(policy: dict, label: str) -> None:
    """Policy B on Simulate: its kept values set (its widgets take them when drawn)."""
    s["policy_b"] = dict(policy)
    s["policy_b_label"] = label
    s["simulate_b_text"] = "\n".join(data.overrides_of(policy))
    s["simulate_compare_on"] = True
    for widget in ("simulate_b", "simulate_compare"):
        s.pop(widget, None)
    st.switch_page(ui.PAGES["simulate"])


tab_open, tab_run = st.tabs(["open a plan", "run the planner"])
with tab_run:
    try:
        scenario = ui.current_scenario()
    except InputError as e:
        ui.show_error(e)
        st.stop()
    st.caption(f"Searches recovery policies for **{scenario.run.name}** on the twin (`keel plan`); "
               "a few trials and replicas take a minute or so.")
    c1, c2 = st.columns(2)
    trials = c1.number_input("trials", min_value=2, value=12, step=1, key="plan_trials")
    replicas = c2.number_input("replicas per trial", min_value=1, value=2, step=1, key="plan_replicas")
    out = Path(st.text_input("output directory", value=str(ui.runs_root() / f"plan-{scenario.run.name}"),
                             key="plan_out"))
    if st.button("Run the planner", type="primary", key="plan_run"):
        scenario_file = ui.scenario_file_for(scenario, out)
        cmd = [sys.executable, "-m", "keel.cli", "plan", str(scenario_file), "--trials", str(int(trials)),
               "--replicas", str(int(replicas)), "--out", str(out)]
        with st.status(f"planning: {int(trials)} trials x {int(replicas)} replicas", expanded=False) as status:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                status.update(label=f"keel plan failed (exit {proc.returncode})", state="error")
                st.code((proc.stderr or proc.stdout)[-3000:], language=None)
                st.stop()
            status.update(label=f"wrote {out / 'plan.json'}", state="complete")
        s["plan_dir:typed"] = str(out)

with tab_open:
    picked = ui.pick_dir("plan directory", ["plan"], key="plan_dir")
if picked is None:
    st.info(f"No plan under `{ui.runs_root()}`: run the planner here, or `keel plan SCENARIO --out DIR`.")
    st.stop()
try:
    plan = data.cached_plan(picked)
except InputError as e:
    ui.show_error(e)
    st.stop()

rows = data.plan_rows(plan)
st.subheader(f"{plan.get('scenario', picked.name)}: {data.plan_counts(plan)}"
             + (f" x {plan['replicas']} replica{'s' * (plan['replicas'] != 1)}" if plan.get("replicas") else ""))
if plan.get("rule"):
    st.caption(f"recommendation rule: {plan['rule']}")
current = ui.current_scenario_or_none()
if current is not None and plan.get("scenario") and plan["scenario"] != current.run.name:
    st.warning(f"This plan was made for **{plan['scenario']}**; Simulate runs the current scenario, "
               f"**{current.run.name}** (load {plan['scenario']} on the Topology page to match).")
chosen = {tag: plan[tag] for tag in ("recommended", "baseline") if isinstance(plan.get(tag), dict)}
cols = st.columns(len(chosen) or 1)
for col, (tag, entry) in zip(cols, chosen.items()):
    with col:
        number = next((r["number"] for r in rows if r[tag]), None)
        st.markdown(f"**{tag}**" + (f" (candidate #{number})" if number is not None else ""))
        a, b = st.columns(2)
        base_good = (chosen.get("baseline") or {}).get("goodput")
        a.metric("goodput", data.fmt(entry.get("goodput"), ".4f"),
                 delta=(data.fmt(entry.get("goodput"), "+.4f", minus=base_good)
                        if tag == "recommended" and base_good is not None and entry.get("goodput") is not None else None))
        b.metric("cost (node-h / useful step)", data.fmt(entry.get("cost_node_hours_per_step"), ".4g"))
        policy = data.policy_of(entry)
        st.code("\n".join(data.overrides_of(policy)) or "(the scenario's own policy)", language=None)
        if st.button(f"Send {tag} to Simulate", key=f"plan_send_{tag}", type="primary" if tag == "recommended" else "secondary"):
            send(policy, f"plan {tag}")
rec_row = next((r for r in rows if r["recommended"]), None)
if rec_row is not None and not rec_row["pareto"]:
    fitted = (plan.get("interval_refinement") or {}).get("fitted") == rec_row["number"]
    st.caption(f"The recommended candidate #{rec_row['number']} is not on the Pareto front"
               + (": its checkpoint interval is the optimum of the fitted a - b/tau - c*tau, where goodput is "
                  "flat, rather than the grid point that scored highest on these seeds." if fitted else "."))

st.altair_chart(charts.pareto_chart(plan), width="content")
st.dataframe(data.plan_table(plan), hide_index=True)
numbers = [r["number"] for r in rows]
if numbers:
    c1, c2 = st.columns([1, 3])
    number = int(c1.selectbox("candidate", [f"#{n}" for n in numbers], key="plan_trial")[1:])
    trial = next(t for t in plan["trials"] if t.get("number") == number)
    c2.code("\n".join(data.overrides_of(data.policy_of(trial))) or "(the scenario's own policy)", language=None)
    if c1.button("Send this candidate to Simulate", key="plan_send_trial"):
        send(data.policy_of(trial), f"plan candidate #{number}")
