"""`keel report DIR [--html FILE]`: the dashboard's charts for one directory in a single
static HTML file that works offline.

DIR is a run (`keel simulate` / `keel run`: events.jsonl + summary.json), a validation
(`keel validate`: comparison.json, twin/, runtime/rep-K/) or a plan (`keel plan`: plan.json).

Offline: the charts are Vega-Lite specs rendered in the page by vega-embed, and the
JavaScript comes from a package that is installed anyway, never from a CDN. Streamlit ships
vega, vega-lite and vega-embed as ES-module chunks (`streamlit/static/static/js/embed.*.js`
and the chunks it imports); the report inlines that chunk graph as `data:` URLs behind an
import map. Where a Streamlit build lays its chunks out differently, the report falls back to
`vl-convert-python`'s bundle (`vl_convert.javascript_bundle`) when that is installed, and
otherwise refuses with a message, rather than writing a report that needs the network.
"""
from __future__ import annotations

import base64
import datetime as dt
import html
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from keel.errors import InputError

Section = tuple[str, Any]  # (title, an Altair chart | rows for a table | a paragraph)


# ----------------------------------------------------------------------------- offline JS

_CHUNK_REF = re.compile(r"""(["'`])\./([A-Za-z0-9_.\-]+\.js)\1""")
_PREFIX = "keel-vega/"


def _streamlit_chunks() -> tuple[str, dict[str, str]] | None:
    """(entry chunk name, {chunk name: source with imports rewritten to `keel-vega/NAME`})
    for Streamlit's vega-embed chunk and everything it imports, or None."""
    try:
        import streamlit
    except ImportError:
        return None
    folder = Path(streamlit.__file__).parent / "static" / "static" / "js"
    entries = sorted(p for p in folder.glob("embed.*.js") if "vegaLite" in p.read_text(errors="ignore"))
    if not entries:
        return None
    entry = entries[0].name
    sources: dict[str, str] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in sources:
            continue
        path = folder / name
        if not path.is_file():
            return None
        text = path.read_text()
        todo += [m.group(2) for m in _CHUNK_REF.finditer(text)]
        sources[name] = _CHUNK_REF.sub(lambda m: f"{m.group(1)}{_PREFIX}{m.group(2)}{m.group(1)}", text)
    return entry, sources


_LOADER = """
function keelEmbed(embed) {
  for (const el of document.querySelectorAll("div[data-spec]")) {
    const spec = JSON.parse(document.getElementById(el.dataset.spec).textContent);
    embed(el, spec, {actions: false, renderer: "svg"})
      .then(() => el.setAttribute("data-rendered", "true"))
      .catch(err => { el.classList.add("chart-error"); el.textContent = "chart failed: " + err; });
  }
}
"""


def vega_scripts(source: str = "auto") -> str:
    """The <script> tags that render every `div[data-spec]` of the page, with no network.
    `source`: "auto" (Streamlit's chunks, else vl-convert), "streamlit" or "vl-convert"."""
    found = _streamlit_chunks() if source in ("auto", "streamlit") else None
    if found:
        entry, sources = found
        imports = {f"{_PREFIX}{name}": "data:text/javascript;base64," + base64.b64encode(src.encode()).decode()
                   for name, src in sources.items()}
        return (f'<script type="importmap">{json.dumps({"imports": imports})}</script>\n'
                f'<script type="module">{_LOADER}\n'
                f'import * as chunk from {json.dumps(_PREFIX + entry)};\n'
                # the chunk's exports are minified names; vega-embed's namespace is the one
                # whose default export is a function with `vega` and `vegaLite` beside it
                'const ns = Object.values(chunk).find(v => v && typeof v.default === "function" && v.vega && v.vegaLite)\n'
                '  || Object.values(chunk).find(v => v && typeof v.default === "function");\n'
                'keelEmbed(ns.default);\n</script>')
    if source == "streamlit":
        raise InputError("keel report: this Streamlit build has no vega-embed chunk (static/static/js/embed.*.js)")
    try:
        import vl_convert
        from altair.utils._importers import vl_version_for_vl_convert
    except ImportError:
        raise InputError("keel report: no offline copy of vega-embed found (neither Streamlit's "
                         "static chunks nor vl-convert-python); install vl-convert-python") from None
    bundle = vl_convert.javascript_bundle(vl_version=vl_version_for_vl_convert())  # sets window.vegaEmbed
    bundle = bundle.replace("</script", "<\\/script")
    return (f"<script>{bundle}</script>\n"
            f"<script>{_LOADER}\nkeelEmbed(window.vegaEmbed);\n</script>")


# ----------------------------------------------------------------------------- HTML

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2rem; } .meta { color: #666; margin-top: 0; }
section { margin: 2rem 0; } table { border-collapse: collapse; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f4f4f4; } td.text { text-align: left; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
.chart-error { color: #cf222e; }
"""


def _cell(v: Any) -> str:
    if v is True or v == "pass":
        return '<td class="pass">pass</td>'
    if v is False or v == "fail":
        return '<td class="fail">fail</td>'
    if v is None:
        return "<td></td>"
    if isinstance(v, float):
        return f"<td>{v:.4g}</td>"
    if isinstance(v, int):
        return f"<td>{v}</td>"
    return f'<td class="text">{html.escape(str(v))}</td>'


def table_html(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell(r.get(c)) for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(title: str, meta: str, sections: Iterable[Section], js_source: str = "auto") -> str:
    parts, specs = [], []
    for i, (heading, content) in enumerate(sections):
        body: str
        if hasattr(content, "to_dict"):
            spec = json.dumps(content.to_dict(), allow_nan=False).replace("</", "<\\/")
            specs.append(f'<script type="application/json" id="spec-{i}">{spec}</script>')
            body = f'<div class="chart" data-spec="spec-{i}"></div>'
        elif isinstance(content, str):
            body = f"<p>{html.escape(content)}</p>"
        else:
            body = table_html(list(content))
        parts.append(f"<section><h2>{html.escape(heading)}</h2>\n{body}</section>")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1><p class=\"meta\">{html.escape(meta)}</p>\n"
            + "\n".join(parts) + "\n" + "\n".join(specs) + "\n" + vega_scripts(js_source) + "\n</body></html>\n")


# ----------------------------------------------------------------------------- what goes in

def run_sections(path: Path) -> tuple[str, list[Section]]:
    from app import charts, data
    events, summary = data.load_run(path)
    label = summary.get("tool", "run")
    title = f"{summary.get('scenario', path.name)}: {label} run"
    return title, [
        ("headline", [data.headline(summary)]),
        ("timeline", charts.timeline_chart(events, summary, title=f"{label}: {path.name}")),
        ("progress", charts.progress_chart({label: events})),
        ("downtime per fault", charts.downtime_chart({label: summary})),
        ("faults", data.fault_table(summary)),
    ] + checkpoint_sections(path)


def checkpoint_sections(path: Path) -> list[Section]:
    """A runtime run's checkpoints as the reference reader judges them."""
    from app import data
    checkpoints = data.list_checkpoints(path)
    if not checkpoints:
        return []
    try:
        from keel import ckpt_reader
    except ImportError:
        return [("checkpoints", "(keel.ckpt_reader is not installed: not verified)")]
    rows = data.checkpoint_rows({str(p): ckpt_reader.inspect(p) for p in checkpoints})
    return [("checkpoints, verified by the reference reader", rows)]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def validation_sections(path: Path) -> tuple[str, list[Section]]:
    from app import charts, data
    comparison = data.load_comparison(path)
    runs = {label: data.load_run(p) for label, p in data.validation_runs(path).items()}
    verdict = comparison.get("pass", {})
    title = f"{comparison.get('scenario', path.name)}: predicted vs observed recovery"
    sections: list[Section] = [
        ("verdict", [{"repetitions": comparison.get("repetitions"),
                      "downtime: median error (%)": data.fmt(_pct(comparison.get("downtime_median_rel_err")), ".1f"),
                      "downtime tolerance (%)": data.fmt(_pct(comparison["tolerances"].get("downtime_rel_tol")), "g"),
                      "wall time tolerance (%)": data.fmt(_pct(comparison["tolerances"].get("wall_rel_tol")), "g"),
                      "downtime": data.verdict_text(verdict.get("downtime")), "wall": data.verdict_text(verdict.get("wall")),
                      "all": data.verdict_text(verdict.get("all"))}]),
        ("parity", charts.parity_chart(comparison)),
        ("residuals", charts.residual_chart(comparison)),
        ("errors against the declared tolerances", data.comparison_table(comparison)),
    ]
    if runs:
        offsets = data.launch_offsets(comparison, list(runs))
        sections.append(("timelines: twin above the runtime's repetitions", charts.aligned_timelines(runs, offsets)))
        sections.append(("progress", charts.progress_chart({k: ev for k, (ev, _) in runs.items()}, offsets)))
    return title, sections


def plan_sections(path: Path) -> tuple[str, list[Section]]:
    from app import charts, data
    plan = data.load_plan(path)
    chosen = [{"which": tag, "candidate": data.fmt(plan[tag].get("number"), "d"),
               "goodput": data.fmt(plan[tag].get("goodput"), ".4f"),
               "cost (node-h / useful step)": data.fmt(plan[tag].get("cost_node_hours_per_step"), ".5f"),
               "policy": data.policy_text(data.policy_of(plan[tag]))}
              for tag in ("recommended", "baseline") if isinstance(plan.get(tag), dict)]
    return f"plan: {path.name}", [
        ("recommended against the baseline", chosen),
        ("Pareto front", charts.pareto_chart(plan)),
        ("candidates, ranked (" + data.plan_counts(plan) + ")",
         [{k: {True: "yes", False: ""}.get(v, v) if isinstance(v, bool) else v for k, v in r.items()}
          for r in data.plan_table(plan)]),
    ]


def build(path: str | Path, js_source: str = "auto") -> str:
    from app import data
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: no such directory; expected a run, validation or plan directory")
    kind = data.dir_kind(path)
    builders = {"validation": validation_sections, "run": run_sections, "plan": plan_sections}
    if kind is None:
        raise InputError(f"{path}: expected a run directory (events.jsonl + summary.json), a validation "
                         "directory (comparison.json) or a plan directory (plan.json)")
    title, sections = builders[kind](path)
    meta = f"{kind} directory {path} - keel report, {dt.datetime.now().isoformat(timespec='seconds')}"
    return render(title, meta, sections, js_source)


def cli(args: Any) -> int:
    """`keel report DIR [--html FILE]` (default FILE: DIR/report.html)."""
    out = Path(args.html) if args.html else Path(args.dir) / "report.html"
    text = build(args.dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise InputError(f"--html {out}: cannot write the report ({e.strerror})") from None
    print(f"keel report: wrote {out} ({len(text) // 1024} KiB)", file=sys.stderr)
    return 0
