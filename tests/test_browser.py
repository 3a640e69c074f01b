"""A real browser on the running dashboard: `keel app` on a free port, headless Chromium
(Debian's `chromium`) driven over the DevTools protocol (the `websockets` client Streamlit
already depends on) opens the Compare page, waits for the charts to render, checks that no
exception is shown and saves a screenshot under the test's temp dir. And the static report
rendered offline in the same browser."""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from test_app_runs import REPO, handwritten_validation, runs_root, validation_run

__all__ = ["runs_root"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium; .ci/run does)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Browser:
    """Just enough of the DevTools protocol: one page, evaluate, screenshot."""

    def __init__(self, profile: Path):
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "--window-size=1400,1000", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        wait_until(lambda: port_file.is_file() and len(port_file.read_text().split()) >= 2, 30, "Chromium's DevTools port")
        port, _ = port_file.read_text().split()[:2]
        targets = wait_until(lambda: [t for t in self._json(port, "list") if t.get("type") == "page"], 15, "a page target")
        from websockets.sync.client import connect
        self._conn = connect(targets[0]["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=15)
        self.ws = self._conn.__enter__()
        self.ids = itertools.count(1)

    @staticmethod
    def _json(port: str, path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/{path}", timeout=5) as r:
            return json.loads(r.read())

    def call(self, method: str, timeout: float = 30, **params):
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == n:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")

    def goto(self, url: str, width: int = 1400, height: int = 2600) -> None:
        # one tall viewport from the start: Streamlit scrolls inside its own container, so
        # a full-page picture needs the page laid out at its full height, not resized later
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self._conn.__exit__(None, None, None)
        finally:  # Chromium's own helper processes are in its process group
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def browser(tmp_path):
    b = Browser(Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)))
    yield b
    b.close()


@pytest.fixture
def app_server(runs_root, tmp_path):
    """`keel app --port P` over a runs dir holding one validation (the real one when
    `keel validate` is in the checkout, else the hand-written one)."""
    real, _ = validation_run(runs_root)
    validation = real or handwritten_validation(runs_root)
    root = tmp_path / "runs"
    root.mkdir()
    os.symlink(validation, root / validation.name)
    port = free_port()
    env = dict(os.environ, KEEL_RUNS=str(root), PYTHONPATH=str(REPO))
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "keel.cli", "app", "--port", str(port)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        assert proc.poll() is None, f"keel app exited {proc.returncode}: {(tmp_path / 'app.log').read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    try:
        wait_until(healthy, 60, f"keel app on port {port} to report healthy", every=0.5)
        yield f"http://127.0.0.1:{port}", validation
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


RENDERED = """(() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  const drawn = charts.filter(c => c.querySelector('canvas, svg'));
  return JSON.stringify({charts: charts.length, drawn: drawn.length,
    exceptions: [...document.querySelectorAll('[data-testid="stException"]')].map(e => e.innerText.slice(0, 400)),
    running: !!document.querySelector('[data-testid="stStatusWidget"]'),
    title: (document.querySelector('h1') || {}).innerText || ''});
})()"""


@pytest.mark.timeout(600)
def test_compare_page_in_a_real_browser(app_server, browser, tmp_path):
    url, validation = app_server
    browser.goto(f"{url}/compare")

    def ready():
        state = json.loads(browser.evaluate(RENDERED) or "{}")
        assert not state.get("exceptions"), f"the page shows an exception: {state['exceptions']}"
        return state if state.get("drawn", 0) >= 4 and state["drawn"] == state["charts"] and not state["running"] else None
    state = wait_until(ready, 90, "the Compare page's charts to render")
    time.sleep(1.5)  # let the last chart finish its layout before the picture
    state = json.loads(browser.evaluate(RENDERED))
    assert not state["exceptions"]
    assert "Compare" in state["title"]
    shot = browser.screenshot(tmp_path / "compare.png")
    body = browser.evaluate("document.body.innerText")
    (tmp_path / "compare.txt").write_text(body)
    assert "errors against the declared tolerances" in body and "runtime repetitions" in body
    assert shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("js", ["auto", "vl-convert"])
def test_report_renders_offline_in_a_browser(runs_root, browser, tmp_path, js):
    validation = handwritten_validation(runs_root)
    out = tmp_path / "report.html"
    if js == "auto":  # what `keel report` does: Streamlit's own vega-embed chunks
        proc = subprocess.run([sys.executable, "-m", "keel.cli", "report", str(validation), "--html", str(out)],
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
    else:  # the fallback for a Streamlit build without those chunks
        pytest.importorskip("vl_convert", reason="vl-convert-python is not installed (the report's fallback)")
        from app import report
        out.write_text(report.build(validation, js_source="vl-convert"))
    browser.goto(out.as_uri())
    expected = out.read_text().count('class="chart" data-spec=')

    def done():
        r = json.loads(browser.evaluate("JSON.stringify({ok: document.querySelectorAll('div[data-rendered=true] svg').length,"
                                        " failed: [...document.querySelectorAll('.chart-error')].map(e => e.innerText)})") or "{}")
        assert not r.get("failed"), r["failed"]
        return r.get("ok") == expected
    wait_until(done, 30, f"{expected} charts of the report to render")
    browser.screenshot(tmp_path / "report.png")
