"""Topology: load a scenario, see the cluster as a graph grouped by region, edit it (add or
remove regions and links, nodes per region, link latency and bandwidth, fault rates, policy
knobs), see what the twin predicts for it, save it as a new file. A value edit is a
`--set`-style override, an added or removed region or link a new base scenario; both are
checked by the scenario schema, and a refused edit shows the schema's message and leaves the
current scenario as it was."""
from pathlib import Path

import streamlit as st

from app import charts, data, ui
from keel import fault_classes
from keel import scenario as sc
from keel.errors import InputError

ui.entry_guard()

s = st.session_state
s.setdefault("topology_gen", 0)       # bumps when a new file is loaded: fresh widgets
s.setdefault("topology_draft", {})    # dotted key -> value of every widget, kept across pages
s.setdefault("topology_extra", "")    # free-form key=value lines


def load(path: str) -> None:
    try:
        ui.load_scenario_file(path)
    except InputError as e:
        s["topology_load_error"] = str(e)
        return
    s["topology_load_error"] = None
    _fresh_widgets()


def _fresh_widgets() -> None:
    """A new base scenario: drop the edits in progress; fresh widgets (a new generation) show it."""
    s["topology_draft"] = {}
    s["topology_extra"] = ""
    s["topology_gen"] += 1


st.title("Topology")
files = [str(p) for p in ui.scenario_files()]
top = st.columns([3, 2])
with top[0]:
    current_path = s["scenario_path"]
    file_key = f"topology_file{s['topology_gen']}"
    st.selectbox("scenario file", files, index=files.index(current_path) if current_path in files else 0,
                 key=file_key, on_change=lambda k: load(s[k]), args=(file_key,))
with top[1]:
    typed = st.text_input("or a scenario path", key="topology_path")
    if typed.strip() and st.button("Load path", key="topology_load_path"):
        load(typed.strip())
        st.rerun()
if s.get("topology_load_error"):
    st.error(s["topology_load_error"])

try:
    file_scenario = ui.file_scenario()
    base = ui.base_scenario()
except InputError as e:
    ui.show_error(e)
    st.stop()


def reshape(op, *keys) -> None:
    """A button's callback: the current scenario (its value edits kept) with a region or a
    link added or removed becomes the new base; fresh widgets show it."""
    try:
        plain = op(ui.current_scenario().plain(), *[s[k] for k in keys])
        ui.reshape(plain)
    except InputError as e:
        s["topology_reshape_error"] = str(e)
        return
    s["topology_reshape_error"] = None
    _fresh_widgets()

gen = s["topology_gen"]
draft: dict = s["topology_draft"]
values: dict = {}


def field(kind: str, key: str, label: str, current, **kw):
    """One widget for the dotted `key`, initialised from the draft (else the file)."""
    value = draft.get(key, current)
    wkey = f"topo{gen}:{key}"
    if kind == "int":
        values[key] = st.number_input(label, value=int(value), step=1, key=wkey, **kw)
    elif kind == "float":
        values[key] = st.number_input(label, value=float(value), key=wkey, format="%g", **kw)
    elif kind == "text":
        values[key] = st.text_input(label, value=str(value), key=wkey, **kw)
    elif kind == "select":
        opts = kw.pop("options")
        values[key] = st.selectbox(label, opts, index=opts.index(value), key=wkey, **kw)
    elif kind == "bool":
        values[key] = st.checkbox(label, value=bool(value), key=wkey, **kw)


edit_col, graph_col = st.columns([2, 3])
with edit_col:
    field("text", "run.name", "run name", base.run.name)
    with st.expander("Regions", expanded=True):
        for i, r in enumerate(base.regions):
            field("int", f"regions.{i}.nodes", f"{r.name}: nodes", r.nodes)
    with st.expander("Links", expanded=True):
        for i, link in enumerate(base.links):
            c1, c2 = st.columns(2)
            with c1:
                field("float", f"links.{i}.rtt_ms", f"{link.a} - {link.b}: RTT (ms)", link.rtt_ms)
            with c2:
                field("float", f"links.{i}.gbit_s", "bandwidth (Gbit/s)", link.gbit_s)
    with st.expander("Add or remove regions and links"):
        names = [r.name for r in base.regions]
        linked = {frozenset((link.a, link.b)) for link in base.links}
        st.markdown("**add a region**")
        c1, c2, c3 = st.columns([2, 1, 2])
        c1.text_input("name", value="new-region", key="topo_add_name")
        c2.number_input("nodes", min_value=1, value=4, step=1, key="topo_add_nodes")
        c3.selectbox("linked to", names, key="topo_add_to")
        c1, c2, c3 = st.columns([2, 2, 1])
        c1.number_input("RTT (ms)", min_value=0.0, value=100.0, key="topo_add_rtt", format="%g")
        c2.number_input("bandwidth (Gbit/s)", min_value=0.1, value=200.0, key="topo_add_gbit", format="%g")
        c3.button("Add", key="topo_add", on_click=reshape,
                  args=(data.add_region, "topo_add_name", "topo_add_nodes", "topo_add_to", "topo_add_rtt", "topo_add_gbit"))
        if len(names) > 1:
            st.markdown("**remove a region** (its links and the scheduled faults aimed at it go too)")
            c1, c2 = st.columns([4, 1])
            c1.selectbox("region", names, key="topo_remove_region", label_visibility="collapsed")
            c2.button("Remove", key="topo_remove", on_click=reshape, args=(data.remove_region, "topo_remove_region"))
        missing = [f"{a} - {b}" for i, a in enumerate(names) for b in names[i + 1:] if frozenset((a, b)) not in linked]
        if missing:
            st.markdown("**add a link**")
            c1, c2, c3, c4 = st.columns([3, 2, 2, 1])
            pick = c1.selectbox("between", missing, key="topo_link_pick")
            c2.number_input("RTT (ms)", min_value=0.0, value=100.0, key="topo_link_rtt", format="%g")
            c3.number_input("Gbit/s", min_value=0.1, value=200.0, key="topo_link_gbit", format="%g")
            a, b = pick.split(" - ")
            c4.button("Add", key="topo_link_add", on_click=reshape,
                      args=(lambda plain, rtt, gbit, a=a, b=b: data.add_link(plain, a, b, rtt, gbit),
                            "topo_link_rtt", "topo_link_gbit"))
        if base.links:
            st.markdown("**remove a link** (the regions must stay connected)")
            c1, c2 = st.columns([4, 1])
            pick = c1.selectbox("link", [f"{link.a} - {link.b}" for link in base.links], key="topo_unlink_pick",
                                label_visibility="collapsed")
            a, b = pick.split(" - ")
            c2.button("Remove", key="topo_unlink", on_click=reshape,
                      args=(lambda plain, a=a, b=b: data.remove_link(plain, a, b),))
        if s.get("topology_reshape_error"):
            st.error(s["topology_reshape_error"], icon=":material/error:")
    with st.expander("Fault rates"):
        f = base.faults
        for fc in fault_classes.classes():
            field("float", f"faults.{fc.name}.{fc.rate_key}", fc.rate_label, getattr(getattr(f, fc.name), fc.rate_key))
    with st.expander("Policy"):
        p = base.policy
        field("select", "policy.kind", "policy", p.kind, options=["absorb", "checkpoint_restart"])
        field("int", "policy.hot_spares", "hot spares", p.hot_spares)
        field("float", "policy.heartbeat_s", "heartbeat (s)", p.heartbeat_s)
        field("float", "policy.detect_timeout_s", "detect timeout (s)", p.detect_timeout_s)
        field("float", "policy.straggler_factor", "straggler factor", p.straggler_factor)
        field("int", "checkpoint.interval_steps", "checkpoint interval (steps)", base.checkpoint.interval_steps)
    extra = st.text_area("more edits, one `dotted.key=value` a line", value=s["topology_extra"], key=f"topo{gen}:extra",
                         help="any scenario key, as with `keel ... --set`, e.g. regions.2.speed=0.8")

s["topology_draft"] = dict(values)
s["topology_extra"] = extra
overrides = data.edit_overrides(base, values, extra)
try:
    edited = ui.base_scenario(overrides)
    s["scenario_overrides"] = overrides
    edit_error = None
except InputError as e:
    edit_error = str(e)
    edited = ui.current_scenario()

with graph_col:
    if edit_error:
        st.error(edit_error, icon=":material/error:")
        st.caption("The graph shows the last valid scenario.")
    st.altair_chart(charts.topology_chart(edited), width="content")
    if ui.twin_available():
        with st.spinner("the twin: predicting this cluster"):
            summary = ui.twin_headline(edited)
        h = data.headline(summary)
        st.caption(f"the twin on this cluster (seed {edited.run.seed}, {edited.run.steps} steps), re-run on every edit:")
        cols = st.columns(4)
        cols[0].metric("goodput", data.fmt(h["goodput"], ".4f"))
        cols[1].metric("wall time", ui.seconds(h["wall_s"]))
        cols[2].metric("faults", h["faults"])
        cols[3].metric("restarts", data.fmt(h["restarts"], "d"))
    changes = data.structure_changes(file_scenario, edited)
    st.caption(f"config hash `{edited.config_hash()[:16]}`; "
               + (f"{len(changes)} change{'s' * (len(changes) != 1)} over the file" if changes else "as in the file"))
    if changes:
        st.code("\n".join(changes), language=None)

    st.subheader("Save as a new scenario file")
    folder = ui.runs_root() / "scenarios"
    name = st.text_input("file name", value=f"{edited.run.name}.toml", key=f"topology_save_name:{edited.run.name}")
    if st.button("Save", key="topology_save", disabled=bool(edit_error)):
        target = Path(name) if Path(name).is_absolute() or "/" in name else folder / name
        if target.suffix != ".toml":
            st.error(f"{target}: expected a file name ending in .toml")
        elif target.exists():
            st.error(f"{target}: exists already; choose a new file name")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            text = sc.dumps(edited)
            sc.loads(text, str(target))  # what we write must load back
            target.write_text(text)
            load(str(target))
            s["topology_saved"] = str(target)
            st.rerun()
    if s.get("topology_saved"):
        st.success(f"saved {s['topology_saved']}; it is now the current scenario")
    with st.expander("resolved TOML"):
        st.code(sc.dumps(edited), language="toml")
