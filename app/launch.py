"""`keel app [--port N] [--address A]`: the dashboard, served by Streamlit on 127.0.0.1 by
default, headless, with usage statistics off. The runs it shows are under `KEEL_RUNS`
(default ./runs); `--runs DIR`, where the parser has it, sets that."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from keel.errors import InputError
from keel.net import is_loopback

MAIN = Path(__file__).resolve().parent / "main.py"


def command(port: int, address: str) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(MAIN),
            "--server.port", str(port), "--server.address", address,
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--global.developmentMode", "false", "--server.fileWatcherType", "none",
            "--client.toolbarMode", "viewer"]


def cli(args: Any) -> int:
    port = int(getattr(args, "port", 8501))
    address = str(getattr(args, "address", "127.0.0.1"))
    if not 0 < port < 65536:
        raise InputError(f"--port {port}: expected a TCP port between 1 and 65535")
    env = dict(os.environ)
    runs = getattr(args, "runs", None)
    if runs:
        env["KEEL_RUNS"] = str(Path(runs).resolve())
    elif env.get("KEEL_RUNS"):
        env["KEEL_RUNS"] = str(Path(env["KEEL_RUNS"]).resolve())
    else:
        env["KEEL_RUNS"] = str(Path("runs").resolve())
    root = str(MAIN.parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print(f"keel app: http://{address}:{port}  (runs: {env['KEEL_RUNS']}; Ctrl-C stops it)", file=sys.stderr)
    if not is_loopback(address):
        print(f"keel app: warning: serving beyond this machine on {address}:{port}: anyone who reaches it can "
              f"read every run under {env['KEEL_RUNS']} and start simulations and plans (no authentication)",
              file=sys.stderr)
    proc = subprocess.Popen(command(port, address), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 0
