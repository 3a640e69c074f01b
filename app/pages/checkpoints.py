"""Checkpoints: a run's checkpoints, each verified by the reference reader
(`keel.ckpt_reader`): the seven fields with their sizes, and why a refused one was refused."""
from pathlib import Path

import streamlit as st

from app import data, ui

ui.entry_guard()

st.title("Checkpoints")
root = ui.runs_root()
runs = data.checkpoint_runs(root)
labels = {str(r.path): r.label for r in runs}
choice = st.selectbox("run", list(labels), key="ckpt_run", format_func=lambda p: labels.get(p, p)) if runs else None
typed = st.text_input("or a run / checkpoints directory" if runs else "a run or checkpoints directory", key="ckpt_run:typed")
run = Path(typed.strip()) if typed.strip() else (Path(choice) if choice else None)
if run is None:
    st.info(f"No run with checkpoints under `{root}`: `keel run scenarios/local-8.toml --out {root / 'local-8'}` writes some.")
    st.stop()
checkpoints = data.list_checkpoints(run)
if not checkpoints:
    st.warning(f"{run}: no checkpoints/step-NNNNNNNN/ folders")
    st.stop()

try:
    from keel import ckpt_reader
except ImportError:
    st.warning("The reference reader (`keel.ckpt_reader`) is not part of this checkout yet.")
    st.stop()


@st.cache_data(max_entries=64, show_spinner=False)
def inspect(path: str, _mtime: float) -> dict:
    return ckpt_reader.inspect(path)


infos = {str(p): inspect(str(p), data.mtime(p / "manifest.json")) for p in checkpoints}
st.dataframe(data.checkpoint_rows(infos), hide_index=True)

names = {p: Path(p).name for p in infos}
default = next((p for p in reversed(list(infos)) if infos[p]["ok"]), list(infos)[-1])
picked = st.selectbox("checkpoint", list(names), index=list(names).index(default), key="ckpt_pick",
                      format_func=names.get)
info = infos[picked]
if info["ok"]:
    st.success(f"{names[picked]} verifies: every file is in the manifest with its checksum, and the content is consistent.")
else:
    st.error(f"{names[picked]} is refused by the reference reader:")
    for problem in info["problems"]:
        st.markdown(f"- {problem}")

fields = info.get("fields") or {}
if fields:
    rows = []
    for name in ckpt_reader.FIELDS:
        f = fields.get(name, {})
        detail = {k: v for k, v in f.items() if k not in ("files", "bytes")}
        value = detail.pop("value", None)
        rows.append({"field": name, "size": data.human_bytes(f.get("bytes")), "bytes": f.get("bytes"),
                     "files": ", ".join(f.get("files", [])),
                     "value": "" if value is None else str(value)[:200],
                     "detail": ", ".join(f"{k}={v}" for k, v in detail.items())})
    st.subheader(f"the seven fields (step {info.get('step')}, format {info.get('format')} v{info.get('format_version')})")
    st.dataframe(rows, hide_index=True)
    topology = (fields.get("cluster_topology") or {}).get("value")
    if topology:
        with st.expander("cluster topology"):
            st.json(topology)
