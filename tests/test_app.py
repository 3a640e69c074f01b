"""AppTest of every dashboard page over real runs (twin, planner, validate) produced in the
session, and hand-written ones in the documented formats. Caches are cleared between tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from keel import scenario as sc
from test_app_runs import (REPO, checkpointed_run, handwritten_plan, handwritten_validation, need, plan_run,
                           runs_root, twin_ok, validation_run)

__all__ = ["runs_root"]  # the session fixture, imported for pytest
MAIN = REPO / "app" / "main.py"


@pytest.fixture(autouse=True)
def _fresh_caches():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def open_app(monkeypatch, root: Path, page: str | None = None) -> AppTest:
    monkeypatch.setenv("KEEL_RUNS", str(root))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    if page:
        at.switch_page(f"pages/{page}.py").run()
    return at


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def title_text(spec: dict) -> str:
    t = spec.get("title", "")
    return t.get("text", "") if isinstance(t, dict) else t


def titles(specs: list[dict]) -> list[str]:
    out = []
    for s in specs:
        out.append(title_text(s))
        for sub in s.get("vconcat", []):
            out.append(title_text(sub))
    return out


# ----------------------------------------------------------------------------- Runs

@pytest.mark.timeout(180)
def test_runs_page_without_runs_offers_the_default_scenario(monkeypatch, tmp_path):
    at = open_app(monkeypatch, tmp_path / "empty")
    no_exception(at)
    assert any("No runs under" in i.value for i in at.info)
    assert any("multiregion-46" in t for t in titles(charts(at)))  # the default scenario's graph
    if not twin_ok():
        assert any("twin" in w.value for w in at.warning)
        pytest.skip("the twin is not in this checkout yet: the Run button cannot be pressed")
    at.button(key="run_default").click().run()
    no_exception(at)
    out = tmp_path / "empty" / "multiregion-46"
    assert (out / "events.jsonl").is_file() and (out / "summary.json").is_file()
    assert any(d.value is not None for d in at.dataframe)  # now it lists the run
    assert any(m.label == "goodput" for m in at.metric)


def test_runs_page_lists_runs(monkeypatch, runs_root):
    handwritten_validation(runs_root)
    at = open_app(monkeypatch, runs_root)
    no_exception(at)
    listed = at.dataframe[0].value
    assert "handwritten-validation" in set(listed["job"])
    assert {"validation", "run"} <= set(listed["kind"])
    # a validation's twin and repetitions are listed right under it, as parts of it
    at_validation = list(listed["job"]).index("handwritten-validation")
    parts = listed.iloc[at_validation + 1:at_validation + 4]
    assert [j.strip() for j in parts["job"]] == ["\u21b3 twin", "\u21b3 runtime/rep-0", "\u21b3 runtime/rep-1"]
    assert set(parts["part of"]) == {"handwritten-validation"}
    assert any(m.label == "verdict" for m in at.metric)
    latest = [h.value for h in at.subheader if h.value.startswith("Latest run")]
    assert not any("handwritten-validation" in h for h in latest)  # a job, never a validation's part


def test_runs_page_names_a_runtime_runs_job_and_shows_its_loss(monkeypatch, tmp_path):
    from test_app_runs import FAULTS, _events, write_run
    out = tmp_path / "runs" / "tiny-llama"
    summary = write_run(out, _events(0.02, [(*FAULTS[0], 0.1)], steps=12), "runtime")
    summary.update(losses=[6.2 - 0.05 * k for k in range(12)],
                   job={"entry": "job.py:job", "config": {"hidden_size": 32, "layers": 2}, "params": 51_360})
    (out / "summary.json").write_text(json.dumps(summary))
    at = open_app(monkeypatch, tmp_path / "runs")
    no_exception(at)
    assert "job job.py:job (hidden_size=32, layers=2), 51,360 parameters" in [c.value for c in at.caption]
    loss = [c for c in charts(at) if title_text(c) == "training loss"]
    assert len(loss) == 1 and loss[0]["encoding"]["y"]["field"] == "loss"


def test_simulate_shows_the_job_and_loss_of_any_runtime_run_it_opens(monkeypatch, tmp_path):
    """Not only the newest run's (the Runs page): any runtime run opened on Simulate."""
    from test_app_runs import FAULTS, _events, write_run
    older = tmp_path / "runs" / "resnet"
    summary = write_run(older, _events(0.02, [(*FAULTS[0], 0.1)], steps=6), "runtime")
    summary.update(start_step=8, losses=[2.3, 2.2, 2.0, 1.9, 1.9, 1.8],
                   job={"entry": "job.py:job", "config": {"widths": [8, 16]}, "params": 5_266})
    (older / "summary.json").write_text(json.dumps(summary))
    write_run(tmp_path / "runs" / "newer", _events(0.02, [], steps=4), "runtime")  # the newest: no job recorded
    at = open_app(monkeypatch, tmp_path / "runs", "simulate")
    at.radio(key="simulate_source").set_value("open a run directory").run()
    at.text_input(key="simulate_dir:typed").input(str(older)).run()
    no_exception(at)
    assert "resnet: job job.py:job (widths=[8, 16]), 5,266 parameters" in [c.value for c in at.caption]
    loss = [c for c in charts(at) if title_text(c) == "training loss: resnet"]
    assert len(loss) == 1 and loss[0]["encoding"]["y"]["field"] == "loss"  # its values: test_app_charts


# ----------------------------------------------------------------------------- Topology

def test_topology_shows_the_cluster_and_edits_it(monkeypatch, runs_root):
    at = open_app(monkeypatch, runs_root, "topology")
    no_exception(at)
    spec = charts(at)[0]
    node_layer = next(layer for layer in spec["layer"] if layer.get("mark", {}).get("type") == "point")
    nodes = node_layer["data"]["values"]
    assert len(nodes) == 46 and sum(n["role"] == "hot spare" for n in nodes) == 2
    gen = at.session_state["topology_gen"]
    at.number_input(key=f"topo{gen}:regions.0.nodes").set_value(10).run()
    at.number_input(key=f"topo{gen}:links.0.rtt_ms").set_value(90.0).run()
    no_exception(at)
    assert not at.error
    assert set(at.session_state["scenario_overrides"]) == {"regions.0.nodes=10", "links.0.rtt_ms=90.0"}
    spec = charts(at)[0]
    nodes = next(la for la in spec["layer"] if la.get("mark", {}).get("type") == "point")["data"]["values"]
    assert len(nodes) == 42


@pytest.mark.timeout(180)
def test_topology_adds_and_removes_regions_and_links(monkeypatch, runs_root):
    at = open_app(monkeypatch, runs_root, "topology")
    gen = at.session_state["topology_gen"]
    at.number_input(key=f"topo{gen}:regions.0.nodes").set_value(10).run()  # a value edit, kept through a reshape
    at.text_input(key="topo_add_name").input("sa-east").run()
    at.number_input(key="topo_add_nodes").set_value(6).run()
    at.selectbox(key="topo_add_to").select("us-east").run()
    at.button(key="topo_add").click().run()
    no_exception(at)
    assert not at.error
    current = [r["name"] for r in at.session_state["scenario_reshaped"]["regions"]]
    assert current == ["us-east", "us-west", "eu-west", "sa-east", "ap-southeast"]
    assert at.session_state["scenario_reshaped"]["regions"][0]["nodes"] == 10
    nodes = next(la for la in charts(at)[0]["layer"] if la.get("mark", {}).get("type") == "point")["data"]["values"]
    assert len(nodes) == 46 - 4 + 6
    code = "\n".join(c.value for c in at.code)
    assert "region sa-east added (6 nodes)" in code and "link sa-east - us-east added (100 ms, 200 Gbit/s)" in code
    goodput_before = next(m.value for m in at.metric if m.label == "goodput")
    at.selectbox(key="topo_remove_region").select("eu-west").run()
    at.button(key="topo_remove").click().run()
    no_exception(at)
    regions = [r["name"] for r in at.session_state["scenario_reshaped"]["regions"]]
    assert regions == ["us-east", "us-west", "sa-east", "ap-southeast"]
    assert next(m.value for m in at.metric if m.label == "goodput") != goodput_before  # the twin re-ran
    at.selectbox(key="topo_link_pick").select("us-west - sa-east").run()
    at.button(key="topo_link_add").click().run()
    at.selectbox(key="topo_unlink_pick").select("us-east - us-west").run()
    at.button(key="topo_unlink").click().run()
    no_exception(at)
    links = {frozenset((x["a"], x["b"])) for x in at.session_state["scenario_reshaped"]["links"]}
    assert frozenset(("us-west", "sa-east")) in links and frozenset(("us-east", "us-west")) not in links
    # a region of a name already taken is refused with the schema's message, the cluster kept
    at.button(key="topo_add").click().run()
    no_exception(at)
    assert any("region 'sa-east' is defined twice" in e.value for e in at.error)
    assert [r["name"] for r in at.session_state["scenario_reshaped"]["regions"]] == regions
    at.switch_page("pages/simulate.py").run()  # the other pages work on the reshaped cluster
    no_exception(at)
    assert any("36 nodes, 4 regions" in c.value for c in at.caption)


def test_topology_invalid_edits_show_the_schema_message(monkeypatch, runs_root):
    at = open_app(monkeypatch, runs_root, "topology")
    gen = at.session_state["topology_gen"]
    at.number_input(key=f"topo{gen}:policy.hot_spares").set_value(99).run()
    no_exception(at)
    assert any("key 'policy.hot_spares': expected fewer than the cluster's 46 nodes" in e.value for e in at.error)
    assert at.session_state["scenario_overrides"] == []  # the current scenario is untouched
    at.number_input(key=f"topo{gen}:policy.hot_spares").set_value(2).run()
    at.text_area(key=f"topo{gen}:extra").input("links.0.rtt_s=3").run()
    assert any("did you mean 'rtt_ms'" in e.value for e in at.error)


def test_topology_saves_a_new_scenario_file(monkeypatch, runs_root):
    at = open_app(monkeypatch, runs_root, "topology")
    gen = at.session_state["topology_gen"]
    at.text_input(key=f"topo{gen}:run.name").input("mr46-wide").run()
    at.number_input(key=f"topo{gen}:regions.3.nodes").set_value(12).run()
    at.button(key="topology_save").click().run()
    no_exception(at)
    saved = runs_root / "scenarios" / "mr46-wide.toml"
    loaded = sc.load(saved)
    assert loaded.run.name == "mr46-wide" and loaded.regions[3].nodes == 12 and loaded.total_nodes == 50
    assert at.session_state["scenario_path"] == str(saved)
    assert any(str(saved) in s.value for s in at.success)
    at.button(key="topology_save").click().run()  # a second save refuses to overwrite
    assert any("exists already" in e.value for e in at.error)


# ----------------------------------------------------------------------------- Simulate

@pytest.mark.timeout(180)
def test_simulate_two_policies_on_the_same_fault_trace(monkeypatch, runs_root):
    if not twin_ok():
        pytest.skip("the twin (twin.simulate) is not in this checkout yet")
    at = open_app(monkeypatch, runs_root, "topology")
    at.selectbox(key=f"topology_file{at.session_state['topology_gen']}").select(str(REPO / "scenarios" / "local-8.toml")).run()
    at.switch_page("pages/simulate.py").run()
    no_exception(at)
    at.button(key="simulate_run").click().run()
    no_exception(at)
    results = at.session_state["sim_results"]
    assert list(results) == ["A: absorb", "B: checkpoint_restart"]
    a, b = (r["summary"] for r in results.values())
    trace = [[(f["class"], f["target"], f["at_step"]) for f in s["faults"]] for s in (a, b)]
    assert trace[0] == trace[1] and len(trace[0]) == 4
    assert any("Both policies met the same 4 faults" in c.value for c in at.caption)
    assert a["restarts"] == 0 and b["restarts"] >= 1
    specs = charts(at)
    assert {"goodput", "downtime per fault", "progress"} <= set(titles(specs))
    assert {"A: absorb", "B: checkpoint_restart"} <= set(titles(specs))  # the aligned timelines
    assert len(at.dataframe) == 2
    at.text_input(key="simulate_save_dir").input(str(runs_root / "ab")).run()
    at.button(key="simulate_save").click().run()
    no_exception(at)
    for sub, summary in zip("ab", (a, b)):
        assert json.loads((runs_root / "ab" / sub / "summary.json").read_text())["goodput"] == summary["goodput"]
        assert (runs_root / "ab" / sub / "events.jsonl").stat().st_size > 0


def test_simulate_opens_a_run_directory(monkeypatch, runs_root):
    run = handwritten_validation(runs_root) / "twin"
    at = open_app(monkeypatch, runs_root, "simulate")
    at.radio(key="simulate_source").set_value("open a run directory").run()
    at.text_input(key="simulate_dir:typed").input(str(run)).run()
    no_exception(at)
    tl = next(s for s in charts(at) if "vconcat" in s)
    assert tl["vconcat"][0]["title"] == "twin"
    assert len(at.dataframe[0].value) == 4


# ----------------------------------------------------------------------------- Plan

def _plan_page(monkeypatch, root: Path, plan_dir: Path) -> AppTest:
    at = open_app(monkeypatch, root, "plan")
    at.text_input(key="plan_dir:typed").input(str(plan_dir)).run()
    no_exception(at)
    return at


def test_plan_page_shows_the_front_and_sends_a_policy_to_simulate(monkeypatch, runs_root):
    at = _plan_page(monkeypatch, runs_root, handwritten_plan(runs_root))
    assert "recovery policies: goodput against cost" in titles(charts(at))
    ranked = at.dataframe[0].value
    assert list(ranked["rank"]) == [1, 2, 3, 4, 5] and ranked["recommended"].sum() == 1
    assert ranked["baseline"].sum() == 1 and not (ranked.astype(str) == "None").any().any()
    at.button(key="plan_send_recommended").click().run()
    no_exception(at)
    assert at.session_state["policy_b"] == {"policy.hot_spares": 2, "checkpoint.interval_steps": 200, "policy.kind": "absorb"}
    assert at.session_state["policy_b_label"] == "plan recommended"
    assert any("policy B came from Plan" in c.value for c in at.caption)  # we are on Simulate now


def test_policy_b_from_plan_then_edited(monkeypatch, runs_root):
    at = _plan_page(monkeypatch, runs_root, handwritten_plan(runs_root))
    at.button(key="plan_send_recommended").click().run()
    no_exception(at)
    at.switch_page("pages/simulate.py").run()  # AppTest's next run would be Plan's again, as it opened it
    assert at.text_area(key="simulate_b").value.splitlines() == [
        "policy.hot_spares=2", "checkpoint.interval_steps=200", 'policy.kind="absorb"']
    assert at.checkbox(key="simulate_compare").value is True
    assert any("policy B came from Plan" in c.value for c in at.caption)
    at.text_area(key="simulate_b").input("policy.hot_spares=3").run()
    no_exception(at)
    assert not any("came from Plan" in c.value for c in at.caption)  # edited: no longer Plan's
    at.switch_page("pages/runs.py").run()
    at.switch_page("pages/simulate.py").run()
    assert at.text_area(key="simulate_b").value == "policy.hot_spares=3"  # kept across pages


@pytest.mark.timeout(300)
def test_plan_page_over_a_real_plan(monkeypatch, runs_root):
    plan_dir = need(plan_run(runs_root))
    at = _plan_page(monkeypatch, runs_root, plan_dir)
    assert "recovery policies: goodput against cost" in titles(charts(at))
    plan = json.loads((plan_dir / "plan.json").read_text())
    ranked = at.dataframe[0].value
    assert len(ranked) == len(plan["trials"]) >= 4 and ranked["recommended"].sum() == 1
    counts = next(h.value for h in at.subheader if "candidates" in h.value)
    assert f"{len(plan['trials'])} candidates" in counts  # as `keel plan` prints it
    at.selectbox(key="plan_trial").select_index(1).run()
    at.button(key="plan_send_trial").click().run()
    no_exception(at)
    assert at.session_state["policy_b"]


@pytest.mark.timeout(300)
def test_plan_page_runs_the_planner_on_the_current_scenario(monkeypatch, runs_root, tmp_path):
    need(plan_run(runs_root))  # the planner is in the checkout
    at = open_app(monkeypatch, runs_root, "topology")
    at.selectbox(key=f"topology_file{at.session_state['topology_gen']}").select(str(REPO / "scenarios" / "local-8.toml")).run()
    at.switch_page("pages/plan.py").run()
    at.number_input(key="plan_trials").set_value(3)
    at.number_input(key="plan_replicas").set_value(1)
    at.text_input(key="plan_out").input(str(tmp_path / "plan")).run()
    at.button(key="plan_run").click().run()
    no_exception(at)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["scenario"] == "local-8" and (tmp_path / "plan" / "scenario.toml").is_file()
    assert "recovery policies: goodput against cost" in titles(charts(at))
    assert not at.warning  # made for the current scenario


# ----------------------------------------------------------------------------- Compare

def _compare(monkeypatch, root: Path, validation: Path) -> AppTest:
    at = open_app(monkeypatch, root, "compare")
    at.text_input(key="compare_dir:typed").input(str(validation)).run()
    no_exception(at)
    return at


def test_compare_page_over_a_handwritten_validation(monkeypatch, runs_root):
    at = _compare(monkeypatch, runs_root, handwritten_validation(runs_root))
    specs = charts(at)
    parity = next(s for s in specs if title_text(s).startswith("observed vs predicted"))
    points = next(la for la in parity["layer"] if la["mark"].get("type") == "point")
    assert len(points["data"]["values"]) == 8  # 4 faults x 2 repetitions
    assert "residuals by fault class" in titles(specs)
    assert ["twin", "rep-0", "rep-1"] == [v["title"].split()[0] for v in next(s for s in specs if "vconcat" in s)["vconcat"]]
    table = at.dataframe[0].value
    jitter = table[table["class"] == "network_jitter"].iloc[0]
    assert jitter["pass"] == "fail" and float(jitter["error (%)"]) > 20
    assert {"predicted", "observed", "error (%)", "tolerance (%)", "pass"} <= set(table.columns)
    assert not (table.astype(str) == "None").any().any()
    assert any("outside the declared tolerances" in e.value for e in at.error)


@pytest.mark.timeout(600)
def test_compare_page_over_a_real_validation(monkeypatch, runs_root):
    validation = need(validation_run(runs_root))
    at = _compare(monkeypatch, runs_root, validation)
    comparison = json.loads((validation / "comparison.json").read_text())
    specs = charts(at)
    assert "residuals by fault class" in titles(specs)
    timelines = next(s for s in specs if "vconcat" in s)["vconcat"]
    assert [t["title"].split()[0] for t in timelines] == ["twin", "rep-0", "rep-1"]
    assert len(at.dataframe[0].value) >= len(comparison["faults"])


# ----------------------------------------------------------------------------- Checkpoints

@pytest.mark.timeout(600)
def test_checkpoints_page_verifies_and_explains_a_refusal(monkeypatch, runs_root, tmp_path):
    run = need(checkpointed_run(runs_root))
    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    at = open_app(monkeypatch, tmp_path, "checkpoints")
    at.text_input(key="ckpt_run:typed").input(str(copy)).run()
    no_exception(at)
    listed = at.dataframe[0].value
    assert len(listed) >= 1 and listed["verified"].all()
    assert any("verifies" in s.value for s in at.success)
    fields = at.dataframe[1].value
    assert list(fields["field"]) == ["weights", "optimizer_state", "rng_state", "data_offset", "config_hash",
                                     "cluster_topology", "commit_sha"]
    assert (fields["bytes"] > 0).all()
    # alter one byte of the newest checkpoint's weights: the reader refuses it and says why
    newest = sorted((copy / "checkpoints").iterdir())[-1]
    weights = newest / "weights.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    st.cache_data.clear()
    at.run()
    at.selectbox(key="ckpt_pick").select(str(newest)).run()
    no_exception(at)
    assert any("refused" in e.value for e in at.error)
    assert any("weights.safetensors" in m.value for m in at.markdown)
    listed = at.dataframe[0].value.set_index("checkpoint")
    assert not listed.loc[newest.name, "verified"] and "weights.safetensors" in listed.loc[newest.name, "why refused"]
