"""`keel report DIR [--html FILE]`: one static HTML file with the dashboard's charts, offline
(no script from the network), for a run, a validation or a plan directory."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import pytest

from app import report
from keel.cli import main as keel_main
from test_app_runs import REPO, checkpointed_run, handwritten_plan, handwritten_validation, need, runs_root, twin_run

__all__ = ["runs_root"]


def title_text(spec: dict) -> str:
    t = spec.get("title", "")
    return t.get("text", "") if isinstance(t, dict) else t


def specs(html: str) -> list[dict]:
    return [json.loads(m.replace("<\\/", "</"))
            for m in re.findall(r'<script type="application/json" id="spec-\d+">(.*?)</script>', html, re.S)]


def assert_offline(html: str) -> None:
    assert not re.search(r"<script[^>]+\bsrc=", html), "a script loaded from elsewhere"
    assert not re.search(r"""(?:import|from)\s*\(?\s*["'`]https?://""", html), "an import from the network"
    assert "cdn.jsdelivr" not in html and "unpkg.com" not in html
    assert 'type="importmap"' in html or "vegaEmbed" in html


def test_report_of_a_validation(runs_root, tmp_path):
    validation = handwritten_validation(runs_root)
    out = tmp_path / "r.html"
    assert keel_main(["report", str(validation), "--html", str(out)]) == 0
    html = out.read_text()
    assert_offline(html)
    titles = [title_text(s) for s in specs(html)]
    assert titles[:2] == ["observed vs predicted downtime (band: +-10%)", "residuals by fault class"]
    assert [c["title"].split()[0] for c in specs(html)[2]["vconcat"]] == ["twin", "rep-0", "rep-1"]
    assert "launch 0.8 s before 0" in specs(html)[2]["vconcat"][1]["title"]
    assert "errors against the declared tolerances" in html
    assert html.count('class="fail"') >= 2 and 'class="pass"' in html  # the jitter fault and the verdict


def test_report_of_a_plan_defaults_to_dir_report_html(runs_root):
    plan = handwritten_plan(runs_root)
    assert keel_main(["report", str(plan)]) == 0
    html = (plan / "report.html").read_text()
    assert_offline(html)
    assert [title_text(s) for s in specs(html)] == ["recovery policies: goodput against cost"]
    assert "recommended against the baseline" in html


@pytest.mark.timeout(180)
def test_report_of_a_twin_run(runs_root, tmp_path):
    run = need(twin_run(runs_root))
    out = tmp_path / "sim.html"
    proc = subprocess.run([sys.executable, "-m", "keel.cli", "report", str(run), "--html", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "wrote" in proc.stderr
    html = out.read_text()
    assert_offline(html)
    assert {"progress", "downtime per fault"} <= {title_text(s) for s in specs(html)}
    summary = json.loads((run / "summary.json").read_text())
    assert f"{summary['goodput']:.4g}" in html


@pytest.mark.timeout(600)
def test_report_of_a_runtime_run_lists_its_checkpoints(runs_root, tmp_path):
    run = need(checkpointed_run(runs_root))
    out = tmp_path / "run.html"
    assert keel_main(["report", str(run), "--html", str(out)]) == 0
    html = out.read_text()
    assert_offline(html)
    assert "checkpoints, verified by the reference reader" in html
    assert html.count("step-000000") >= 1 and 'class="fail"' not in html.split("checkpoints, verified")[1]


@pytest.mark.parametrize("make", ["missing", "empty", "bad-json"])
def test_report_of_a_bad_directory_is_exit_2(tmp_path, capsys, make):
    target = tmp_path / "d"
    if make != "missing":
        target.mkdir()
    if make == "bad-json":
        (target / "comparison.json").write_text("{not json")
    assert keel_main(["report", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("keel: ") and str(target) in err and "\n" not in err


def test_offline_scripts_come_from_an_installed_package():
    tags = report.vega_scripts()
    found = re.search(r'<script type="importmap">(.*?)</script>', tags, re.S)
    if found is None:
        pytest.skip("this Streamlit build lays its chunks out differently; the report used vl-convert's bundle")
    imports = json.loads(found.group(1))["imports"]
    assert all(k.startswith("keel-vega/") and v.startswith("data:text/javascript;base64,") for k, v in imports.items())
    sources = [base64.b64decode(v.split(",", 1)[1]).decode() for v in imports.values()]
    for src in sources:  # every relative import is rewritten to a name the import map holds
        for name in re.findall(r"""["'`]keel-vega/([\w.\-]+\.js)["'`]""", src):
            assert f"keel-vega/{name}" in imports
        assert not re.search(r"""["'`]\./[\w.\-]+\.js["'`]""", src)
    assert any("vegaLite" in s for s in sources)
