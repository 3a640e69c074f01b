"""Compare: a validation (`keel validate --out DIR`) read back. The parity plot of observed
against predicted downtime per fault, residuals by fault class, the twin's and the runtime's
timelines one above the other, and the error table against the declared tolerances."""
import streamlit as st

from app import charts, data, ui
from keel.errors import InputError

ui.entry_guard()

st.title("Compare: predicted against observed")
picked = ui.pick_dir("validation directory", ["validation"], key="compare_dir")
if picked is None:
    st.info(f"No validation under `{ui.runs_root()}`. `keel validate scenarios/multiregion-12.toml --out "
            f"{ui.runs_root() / 'validate'}` runs the twin and the runtime on one fault schedule.")
    st.stop()
try:
    comparison = data.cached_comparison(picked)
    runs = {label: data.cached_run(path) for label, path in data.validation_runs(picked).items()}
except InputError as e:
    ui.show_error(e)
    st.stop()

tol = comparison["tolerances"]
verdict = comparison.get("pass", {})
st.caption(f"{comparison.get('scenario')}: {comparison.get('repetitions')} runtime repetitions, "
           f"calibration `{comparison.get('calibration') or 'none'}`, config hash `{str(comparison.get('config_hash'))[:16]}`")
cols = st.columns(4)
median = comparison.get("downtime_median_rel_err")
cols[0].metric("downtime: median rel. error", data.fmt(median, ".1%"),
               help=f"declared tolerance {data.fmt(tol.get('downtime_rel_tol'), '.0%')}")
wall = comparison.get("wall_s") or {}
cols[1].metric("wall time: rel. error", data.fmt(wall.get("rel_err"), ".1%"),
               help=f"declared tolerance {data.fmt(tol.get('wall_rel_tol'), '.0%')}")
good = comparison.get("goodput") or {}
cols[2].metric("goodput predicted / observed", f"{data.fmt(good.get('predicted'), '.3f')} / {data.fmt(good.get('observed'), '.3f')}")
overall = verdict.get("all")
cols[3].metric("verdict", data.verdict_text(overall))
if overall is False:
    failed = [k for k, v in verdict.items() if v is False and k != "all"]
    st.error(f"outside the declared tolerances: {', '.join(failed) or 'see the table'}")

left, right = st.columns(2)
with left:
    st.altair_chart(charts.parity_chart(comparison), width="content")
with right:
    st.altair_chart(charts.residual_chart(comparison), width="content")

st.subheader("errors against the declared tolerances")
st.caption("Each row's figures are in the unit its name gives; errors and tolerances are relative, in %; "
           "'not judged' where no tolerance is declared.")
table = data.comparison_table(comparison)
st.dataframe(table, hide_index=True, column_order=[c for c in table[0] if c != "error of"] + ["error of"] if table else None,
             column_config={"pass": st.column_config.TextColumn("pass", width="small")})

if runs:
    st.subheader("timelines: the twin above the runtime's repetitions")
    offsets = data.launch_offsets(comparison, list(runs))
    if offsets:
        st.caption("The runtime's launch (processes starting, the first group forming), which the twin does not "
                   "model, is shifted before 0, as the validation excluded it from the wall time.")
    st.altair_chart(charts.aligned_timelines(runs, offsets), width="content")
    st.altair_chart(charts.progress_chart({k: ev for k, (ev, _) in runs.items()}, offsets), width="content")
    st.caption("The twin's prediction is the thick dashed black line; each runtime repetition a thin solid one.")
else:
    st.caption("(no twin/ or runtime/rep-K/ event logs beside comparison.json)")
