"""Chart builders and loaders of the dashboard, as pure functions: specs through `.to_dict()`
(which validates them against the Vega-Lite schema), on hand-written runs in the documented
formats."""
from __future__ import annotations

import json

import pytest

from app import charts, data
from keel import scenario as sc
from keel.errors import InputError
from test_app_runs import DEFAULT, LOCAL, _events, FAULTS, handwritten_plan, handwritten_validation


def layers(spec: dict) -> list[dict]:
    return spec.get("layer", [])


def layer(spec: dict, mark: str, field: str | None = None) -> dict:
    """The layer with this mark type (and, if given, this x field)."""
    for la in layers(spec):
        m = la["mark"]["type"] if isinstance(la["mark"], dict) else la["mark"]
        if m == mark and (field is None or la["encoding"].get("x", {}).get("field") == field):
            return la
    raise AssertionError(f"no {mark} layer{f' on {field}' if field else ''} in {[la['mark'] for la in layers(spec)]}")


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    return handwritten_validation(tmp_path_factory.mktemp("v"))


# ----------------------------------------------------------------------------- topology

def test_topology_graph_groups_nodes_by_region_with_spares_and_links():
    s = sc.load(DEFAULT)
    spec = charts.topology_chart(s).to_dict()
    nodes = layer(spec, "point")["data"]["values"]
    assert len(nodes) == 46
    assert {r.name: r.nodes for r in s.regions} == {reg: sum(n["region"] == reg for n in nodes) for reg in {n["region"] for n in nodes}}
    assert [n["node"] for n in nodes if n["role"] == "hot spare"] == ["ap-southeast/6", "ap-southeast/7"]
    links = layer(spec, "rule")["data"]["values"]
    assert len(links) == 6 and {"us-east", "eu-west"} == {links[1]["a"], links[1]["b"]}
    labels = {la["label"] for la in links}
    assert "80 ms, 400 Gbit/s" in labels
    # nodes sit around their own region's centre
    centre = {r["region"]: (r["x"], r["y"]) for r in layers(spec)[-1]["data"]["values"]}
    for n in nodes:
        cx, cy = centre[n["region"]]
        assert (n["x"] - cx) ** 2 + (n["y"] - cy) ** 2 < 0.2 ** 2


def test_topology_of_one_region_has_no_links():
    s = sc.loads('[[regions]]\nname = "solo"\nnodes = 3\n')
    spec = charts.topology_chart(s).to_dict()
    assert layer(spec, "rule")["data"]["values"] == [] and len(layer(spec, "point")["data"]["values"]) == 3


# ----------------------------------------------------------------------------- timelines

def test_timeline_lanes_bars_and_marks():
    events = _events(0.02, [(*f, d) for f, d in zip(FAULTS, [0.3, 0.2, 0.4, 0.1])])
    tl = data.timeline(events)
    assert tl["lanes"] == ["run", "checkpoints", "us-east/1", "eu-west/0", "ap-southeast", "shard/3"]
    episodes = [b for b in tl["bars"] if b["fault_id"] is not None and b["lane"] != "run"]
    assert [b["class"] for b in episodes] == [f[1] for f in FAULTS]
    stalls = [b for b in tl["bars"] if b["state"] == "stalled"]
    assert len(stalls) == 4 and all(b["end"] > b["start"] for b in stalls)
    kinds = [m["kind"] for m in tl["marks"] if m["fault_id"] == 0]
    assert kinds == ["fault", "detect", "recover_start", "recover_end"]
    spec = charts.timeline_chart(events, title="twin").to_dict()
    assert spec["title"] == "twin" and spec["autosize"]["type"] == "pad"
    assert layer(spec, "bar")["encoding"]["y"]["scale"]["domain"] == tl["lanes"]
    assert len(layer(spec, "point")["data"]["values"]) == 16


def test_timeline_marks_a_restart():
    from keel.events import Event
    ev = [Event(0.0, 0, "run_start", detail={"step_time_s": 1.0}), Event(1.0, 1, "step"), Event(2.0, 2, "step"),
          Event(2.5, 2, "fault", "hardware_fault", "a/0", "checkpoint_restart", {"fault_id": 0}),
          Event(3.0, 2, "detect", "hardware_fault", "a/0", "checkpoint_restart", {"fault_id": 0}),
          Event(3.1, 2, "restart", "hardware_fault", "a/0", "checkpoint_restart", {"fault_id": 0}),
          Event(9.0, 1, "recover_end", "hardware_fault", "a/0", "checkpoint_restart", {"fault_id": 0}),
          Event(10.0, 2, "step"), Event(11.0, 3, "step"), Event(11.0, 3, "run_end", detail={"step_time_s": 1.0})]
    tl = data.timeline(ev)
    assert any(b["state"] == "restarting" and b["start"] == 3.1 and b["end"] == 10.0 for b in tl["bars"])
    assert any(m["kind"] == "restart" and m["lane"] == "run" for m in tl["marks"])


def test_aligned_timelines_share_one_time_axis(validation):
    runs = {k: data.load_run(p) for k, p in data.validation_runs(validation).items()}
    spec = charts.aligned_timelines(runs).to_dict()
    assert [c["title"] for c in spec["vconcat"]] == ["twin", "rep-0", "rep-1"]  # no offsets given
    assert spec["resolve"]["scale"]["x"] == "shared"
    domains = {json.dumps(layer(c, "bar")["encoding"]["x"]["scale"]["domain"]) for c in spec["vconcat"]}
    assert len(domains) == 1


def test_timelines_line_up_on_the_start_of_training(validation):
    comparison = data.load_comparison(validation)
    runs = {k: data.load_run(p) for k, p in data.validation_runs(validation).items()}
    offsets = data.launch_offsets(comparison, list(runs))
    assert offsets == {"rep-0": 0.8, "rep-1": 0.6}
    spec = charts.aligned_timelines(runs, offsets).to_dict()
    assert layer(spec["vconcat"][1], "bar")["encoding"]["x"]["scale"]["domain"][0] == -0.8
    first_fault = {c["title"].split()[0]: next(m["t"] for m in layer(c, "point")["data"]["values"] if m["kind"] == "fault")
                   for c in spec["vconcat"]}
    assert first_fault["rep-0"] == pytest.approx(first_fault["twin"], abs=0.02)  # same step, same place
    launching = [b for b in layer(spec["vconcat"][1], "bar")["data"]["values"] if b["state"] == "launching"]
    assert launching == [dict(launching[0], start=-0.8, end=0.0)]
    assert data.launch_offsets({"wall_s": {}}, ["twin", "rep-0"]) == {}


def test_progress_is_thinned_but_keeps_the_last_point():
    events = _events(0.01, [], steps=2000)
    pts = data.progress(events, max_points=100)
    assert len(pts) <= 101 and pts[-1]["step"] == 2000 and pts[0]["step"] == 0
    spec = charts.progress_chart({"run": events}).to_dict()
    assert spec["mark"]["type"] == "line" and spec["encoding"]["y"]["field"] == "step"


# ----------------------------------------------------------------------------- per run

def test_goodput_and_downtime_side_by_side(validation):
    runs = {k: data.load_run(p)[1] for k, p in data.validation_runs(validation).items()}
    g = charts.goodput_chart(runs).to_dict()
    assert [r["run"] for r in g["data"]["values"]] == ["twin", "rep-0", "rep-1"]
    d = charts.downtime_chart(runs).to_dict()
    rows = d["data"]["values"]
    assert len(rows) == 12 and d["encoding"]["xOffset"]["field"] == "run"


def test_fault_rows_and_headline_read_summary_json(validation):
    _, summary = data.load_run(validation / "twin")
    rows = data.fault_rows(summary)
    assert [r["class"] for r in rows] == [f[1] for f in FAULTS]
    assert list(rows[0]) == list(data.FAULT_COLUMNS)
    assert data.headline(summary)["faults"] == 4


# ----------------------------------------------------------------------------- plan

def test_pareto_front_ranked_table_recommended_and_baseline(tmp_path):
    plan = data.load_plan(handwritten_plan(tmp_path))
    rows = data.plan_rows(plan)
    assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["number"] for r in rows][:2] == [2, 0]  # by goodput
    assert [r["number"] for r in rows if r["recommended"]] == [0]
    assert {r["number"] for r in rows if r["pareto"]} == {0, 1, 2}
    spec = charts.pareto_chart(plan).to_dict()
    front = layer(spec, "line")["data"]["values"]
    assert [r["number"] for r in front] == [1, 0, 2]  # along cost
    chosen = layer(spec, "point")["data"]["values"]
    assert [c["which"] for c in chosen] == ["recommended", "baseline"]
    assert data.policy_of(plan["recommended"]) == {"policy.hot_spares": 2, "checkpoint.interval_steps": 200,
                                                   "policy.kind": "absorb"}
    assert data.overrides_of({"policy.kind": "absorb", "policy.hot_spares": 2}) == ['policy.kind="absorb"', "policy.hot_spares=2"]
    # the overrides a plan sends to Simulate are valid --set values for the scenario
    assert sc.load(DEFAULT, data.overrides_of(data.policy_of(plan["baseline"]))).policy.kind == "checkpoint_restart"


def test_plan_without_trials_is_an_input_error(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(InputError, match="trials"):
        data.load_plan(tmp_path)


# ----------------------------------------------------------------------------- compare

def test_parity_plot_has_identity_tolerance_band_error_bars_and_every_repetition(validation):
    comparison = data.load_comparison(validation)
    spec = charts.parity_chart(comparison).to_dict()
    band = layer(spec, "area")
    line = layer(spec, "line")["data"]["values"]
    assert all(p["x"] == p["y"] for p in line)  # y = x
    assert all(p["lo"] == pytest.approx(p["x"] * 0.9) and p["hi"] == pytest.approx(p["x"] * 1.1)
               for p in band["data"]["values"])
    points = layer(spec, "point")["data"]["values"]
    assert len(points) == 8  # 4 faults x 2 repetitions
    assert {(p["fault_id"], p["rep"]) for p in points} == {(f, r) for f in range(4) for r in range(2)}
    err = layer(spec, "rule")
    assert err["encoding"]["x"]["field"] == "predicted_lo" and err["encoding"]["x2"]["field"] == "predicted_hi"
    # the axes share one domain, so y = x is the diagonal
    assert layer(spec, "point")["encoding"]["x"]["scale"]["domain"] == layer(spec, "point")["encoding"]["y"]["scale"]["domain"]
    assert "10%" in spec["title"]["text"]
    # every mark is named: the points, the twin's interval bars, the identity line, the band
    legend = " ".join(spec["title"]["subtitle"])
    assert all(w in legend for w in ("dot", "horizontal bar: the twin's 95% interval", "dashed line", "green band"))


def test_progress_sets_the_twin_apart_from_the_repetitions(validation):
    runs = {label: data.load_run(path)[0] for label, path in data.validation_runs(validation).items()}
    spec = charts.progress_chart(runs).to_dict()
    enc = spec["encoding"]
    assert enc["strokeDash"]["field"] == "source" and enc["color"]["scale"]["domain"] == ["twin", "rep-0", "rep-1"]
    assert enc["color"]["scale"]["range"][0] == charts.TWIN_COLOUR not in enc["color"]["scale"]["range"][1:]
    sources = {r["run"]: r["source"] for r in spec["data"]["values"]}
    assert sources == {"twin": "predicted (twin)", "rep-0": "observed (runtime)", "rep-1": "observed (runtime)"}


def test_pareto_chart_zooms_on_the_front(tmp_path):
    plan = json.loads((handwritten_plan(tmp_path) / "plan.json").read_text())
    outlier = {"number": 9, "source": "tpe", "policy": {"policy.hot_spares": 0, "policy.kind": "absorb"},
               "goodput": 0.60, "goodput_ci95": [0.59, 0.61], "cost_node_hours_per_step": 0.0147}
    plan["trials"].append(outlier)
    spec = charts.pareto_chart(plan).to_dict()
    ydom = layer(spec, "circle")["encoding"]["y"]["scale"]["domain"]
    assert 0.7 < ydom[0] < 0.78 and ydom[1] < 0.96  # the front, the recommended and the baseline; not 0.60
    assert 9 not in {r["number"] for r in layer(spec, "circle")["data"]["values"]}
    assert any("1 of 6 candidates lie outside" in t for t in spec["title"]["subtitle"])


def test_plan_rows_mark_one_recommended_by_number():
    plan = {"recommended": {"number": 2, "policy.kind": "absorb", "goodput": 0.9},
            "baseline": {"number": 0, "policy.kind": "checkpoint_restart", "goodput": 0.8}, "pareto": [{"number": 2}],
            "trials": [{"number": n, "policy": {"policy.kind": "absorb"}, "goodput": g, "cost_node_hours_per_step": 1.0}
                       for n, g in ((0, 0.8), (1, 0.9), (2, 0.9))]}
    rows = data.plan_rows(plan)
    assert [r["number"] for r in rows if r["recommended"]] == [2] and [r["number"] for r in rows if r["baseline"]] == [0]
    assert all(r["recommended"] == r["pareto"] for r in rows)
    table = data.plan_table(plan)
    assert "cost (node-h / useful step)" in table[0] and all("None" not in map(str, r.values()) for r in table)


def test_topology_link_labels_do_not_overlap():
    for s in (sc.load(DEFAULT), sc.load(LOCAL)):
        f = charts.topology_frames(s)
        boxes = [charts._box(la["mx"], la["my"], len(la["label"])) for la in f["links"]]
        assert not any(charts._overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_regions_and_links_added_and_removed():
    s = sc.load(DEFAULT)
    plain = data.add_region(s.plain(), "sa-east", 6, "us-east", 120.0, 100.0)
    plain = data.remove_region(plain, "eu-west")
    plain = data.remove_link(plain, "us-east", "us-west")
    plain = data.add_link(plain, "sa-east", "ap-southeast", 300.0, 50.0)
    edited = sc.from_dict(plain, "edited")
    assert [r.name for r in edited.regions] == ["us-east", "us-west", "sa-east", "ap-southeast"]
    assert edited.node_names[-2:] == s.node_names[-2:]  # the hot spares stay the last nodes
    assert {frozenset((x.a, x.b)) for x in edited.links} == {
        frozenset(p) for p in [("us-west", "ap-southeast"), ("us-east", "ap-southeast"), ("sa-east", "us-east"),
                               ("sa-east", "ap-southeast")]}
    assert all(e.target != "eu-west" for e in edited.faults.schedule) and len(edited.faults.schedule) == 3
    changes = data.structure_changes(s, edited)
    assert "region sa-east added (6 nodes)" in changes and "region eu-west removed" in changes
    assert "link us-east - us-west removed" in changes and "link sa-east - ap-southeast added (300 ms, 50 Gbit/s)" in changes
    with pytest.raises(InputError, match="not connected"):
        sc.from_dict(data.remove_link(data.remove_link(plain, "sa-east", "us-east"), "sa-east", "ap-southeast"), "x")


def test_two_policies_meet_the_same_faults_at_other_steps():
    a = {"faults": [{"fault_id": 0, "class": "hardware_fault", "target": "a/1", "at_step": 4},
                    {"fault_id": 1, "class": "network_jitter", "target": "b/0", "at_step": 2441}]}
    b = {"faults": [{"fault_id": 0, "class": "hardware_fault", "target": "a/1", "at_step": 4},
                    {"fault_id": 1, "class": "network_jitter", "target": "b/0", "at_step": 2260}]}
    text = data.same_faults_text({"A: absorb": a, "B: checkpoint_restart": b})
    assert text.startswith("Both policies met the same 2 faults") and "at steps 2441 (A) / 2260 (B)" in text
    c = {"faults": a["faults"][:1]}
    assert data.same_faults_text({"A": a, "B": c}) is None


def test_display_tables_say_no_none(validation):
    comparison = data.load_comparison(validation)
    table = data.comparison_table(comparison)
    assert all("None" not in map(str, r.values()) for r in table)
    assert {r["pass"] for r in table} <= {"pass", "fail", "not judged"}
    good = next(r for r in table if r["row"].startswith("goodput"))
    assert good["pass"] == "not judged" and good["tolerance (%)"] == data.MISSING
    summary = data.load_run(validation / "twin")[1]
    rows = data.fault_table({**summary, "faults": [{**summary["faults"][0], "action": None, "cost_s": None}]})
    assert rows[0]["action"] == data.MISSING and rows[0]["cost (s)"] == data.MISSING and "downtime (s)" in rows[0]


def test_residuals_by_class_with_band(validation):
    comparison = data.load_comparison(validation)
    spec = charts.residual_chart(comparison).to_dict()
    points = layer(spec, "circle")["data"]["values"]
    jitter = [p["rel_residual"] for p in points if p["class"] == "network_jitter"]
    assert len(jitter) == 2 and all(r > 0.25 for r in jitter)
    assert layer(spec, "rect")["data"]["values"] == [{"lo": -0.1, "hi": 0.1}]
    # the classes the comparison has, in FAULT_CLASSES order (it has no coordinator_loss)
    assert layer(spec, "circle")["encoding"]["x"]["scale"]["domain"] == list(sc.FAULT_CLASSES[:4])
    assert set(charts.FAULT_COLOURS) == set(sc.FAULT_CLASSES)


def test_error_table_passes_and_fails_against_declared_tolerances(validation):
    rows = data.comparison_rows(data.load_comparison(validation))
    by = {r["row"]: r for r in rows}
    assert [by[f"fault {i}"]["pass"] for i in range(4)] == [True, False, True, True]
    assert by["downtime (median)"]["tolerance"] == 0.10 and by["wall_s"]["tolerance"] == 0.05
    assert by["goodput"]["pass"] is None
    assert by["wall_s"]["error of"] == "the twin's mean against the repetitions' median"


def test_comparison_without_faults_is_an_input_error(tmp_path):
    (tmp_path / "comparison.json").write_text('{"tolerances": {}}')
    with pytest.raises(InputError, match="missing key 'faults'"):
        data.load_comparison(tmp_path)


# ----------------------------------------------------------------------------- directories

def test_directory_kinds_and_listing(tmp_path, validation):
    assert data.dir_kind(validation) == "validation"
    assert data.dir_kind(validation / "twin") == "run"
    assert data.dir_kind(tmp_path) is None
    found = data.list_runs(validation.parent)
    labels = {r.label: r.kind for r in found}
    assert labels[validation.name] == "validation" and labels[f"{validation.name}/runtime/rep-1"] == "run"
    assert list(data.validation_runs(validation)) == ["twin", "rep-0", "rep-1"]
    assert data.list_runs(tmp_path / "missing") == []


def test_scenario_edits_round_trip_through_dumps():
    s = sc.load(LOCAL, ["regions.0.nodes=3", "links.0.rtt_ms=12.5"])
    again = sc.loads(sc.dumps(s), "saved.toml")
    assert again.to_dict() == s.to_dict() and again.config_hash() == s.config_hash()


def test_topology_edits_become_set_overrides():
    base = sc.load(LOCAL)
    values = {"regions.0.nodes": 2, "regions.1.nodes": 3, "links.0.rtt_ms": 0.1, "policy.kind": "checkpoint_restart",
              "run.name": "local-8"}
    assert data.edit_overrides(base, values, "# a comment\n  faults.data_shard_skew.per_day=2\n") == [
        "regions.1.nodes=3", 'policy.kind="checkpoint_restart"', "faults.data_shard_skew.per_day=2"]
    edited = sc.load(LOCAL, data.edit_overrides(base, values))
    assert edited.regions[1].nodes == 3 and edited.policy.kind == "checkpoint_restart"


def test_error_table_judges_each_fault_by_its_own_tolerance_and_shows_the_emulation():
    comparison = {"tolerances": {"downtime_rel_tol": 0.10, "fault_rel_tol": 0.15, "wall_rel_tol": 0.05},
                  "faults": [{"fault_id": 0, "class": "hardware_fault", "target": "a/1", "downtime_rel_err": 0.12,
                              "predicted": {"downtime_s": 11.2}, "observed": {"downtime_s": 10.0}}],
                  "downtime_median_rel_err": 0.12,
                  "emulation": [{"overruns": 30, "reports": 1000, "max_overrun_fraction": 0.02},
                                {"overruns": 0, "reports": 1000, "max_overrun_fraction": 0.02}],
                  "pass": {"downtime": False, "each_fault": True, "wall": True, "valid": False, "all": False}}
    by = {r["row"]: r for r in data.comparison_rows(comparison)}
    assert by["fault 0"]["tolerance"] == 0.15 and by["fault 0"]["pass"] is True
    assert by["downtime (median)"]["tolerance"] == 0.10 and by["downtime (median)"]["pass"] is False
    assert by["emulation"]["rel_err"] == pytest.approx(0.015) and by["emulation"]["pass"] is False
    assert "30 of 2000" in by["emulation"]["error of"]


def test_runs_are_grouped_by_job_newest_first(tmp_path):
    import os
    validation = handwritten_validation(tmp_path)
    old_run = tmp_path / "demo" / "simulate"
    new_run = tmp_path / "demo" / "run"
    for run, age in ((old_run, 300), (new_run, 0)):
        run.mkdir(parents=True)
        (run / "events.jsonl").write_text("")
        (run / "summary.json").write_text("{}")
        t = (validation / "comparison.json").stat().st_mtime + 100 - age
        os.utime(run / "summary.json", (t, t))
    (new_run / "checkpoints").mkdir()
    (validation / "runtime" / "rep-0" / "checkpoints").mkdir()
    runs = data.list_runs(tmp_path)
    assert [(r.label, r.is_job) for r in runs] == [
        ("demo/run", True), ("handwritten-validation", True), ("handwritten-validation/twin", False),
        ("handwritten-validation/runtime/rep-0", False), ("handwritten-validation/runtime/rep-1", False),
        ("demo/simulate", True)]
    table = data.runs_table(runs)
    assert [r["job"].strip() for r in table][1:3] == ["handwritten-validation", "\u21b3 twin"]
    assert table[2]["part of"] == "handwritten-validation" and "None" not in str(table)
    assert [r.label for r in data.checkpoint_runs(tmp_path)] == ["demo/run", "handwritten-validation/runtime/rep-0"]
    only_runs = data.jobs_first(data.list_runs(tmp_path, kinds=("run",)))
    assert only_runs[0].label == "demo/run" and only_runs[1].label == "demo/simulate"


def test_loss_chart_and_job_line_of_a_runtime_summary():
    summary = {"start_step": 10, "losses": [3.0, 2.5, 2.25],
               "job": {"entry": "runtime.job_gpt:job", "config": {f"k{i}": i for i in range(10)}, "params": 136_960}}
    spec = charts.loss_chart(summary).to_dict()
    assert [r["step"] for r in spec["data"]["values"]] == [11, 12, 13]
    assert [r["loss"] for r in spec["data"]["values"]] == [3.0, 2.5, 2.25]
    assert data.job_line(summary) == ("job runtime.job_gpt:job (k0=0, k1=1, k2=2, k3=3, k4=4, k5=5, k6=6, k7=7, ...), "
                                      "136,960 parameters")
    assert data.job_line({"tool": "twin"}) is None
    assert data.job_line({"job": {"entry": "m:f", "config": {}, "params": None}}) == "job m:f"
