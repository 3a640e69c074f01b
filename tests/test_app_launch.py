"""`keel app`: the Streamlit command it runs, and its input checks (the server itself is
started by tests/test_browser.py)."""
from __future__ import annotations

import argparse

import pytest

from app import launch
from keel.cli import build_parser, main as keel_main
from keel.errors import InputError


def test_command_is_headless_local_and_without_telemetry():
    cmd = launch.command(8501, "127.0.0.1")
    flags = dict(zip(cmd[cmd.index(str(launch.MAIN)) + 1::2], cmd[cmd.index(str(launch.MAIN)) + 2::2]))
    assert cmd[1:4] == ["-m", "streamlit", "run"] and launch.MAIN.name == "main.py"
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.port"] == "8501"
    assert flags["--server.headless"] == "true" and flags["--browser.gatherUsageStats"] == "false"


def test_defaults_are_127_0_0_1_and_8501():
    args = build_parser().parse_args(["app"])
    assert (args.address, args.port) == ("127.0.0.1", 8501)


@pytest.mark.parametrize("port", [0, 70000])
def test_a_bad_port_is_exit_2(port, capsys):
    assert keel_main(["app", "--port", str(port)]) == 2
    assert "--port" in capsys.readouterr().err


def test_runs_directory_reaches_the_app(monkeypatch, tmp_path, capsys):
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env):
            seen.update(cmd=cmd, env=env)

        def wait(self):
            return 0
    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KEEL_RUNS", raising=False)
    assert launch.cli(argparse.Namespace(port=8600, address="127.0.0.1")) == 0
    assert seen["env"]["KEEL_RUNS"] == str(tmp_path / "runs")
    assert launch.cli(argparse.Namespace(port=8600, address="0.0.0.0", runs=str(tmp_path / "elsewhere"))) == 0
    assert seen["env"]["KEEL_RUNS"] == str(tmp_path / "elsewhere") and "0.0.0.0" in seen["cmd"]
    err = capsys.readouterr().err  # loopback is quiet; any other address warns what it exposes
    assert err.count("warning: serving beyond this machine on 0.0.0.0:8600") == 1
    with pytest.raises(InputError):
        launch.cli(argparse.Namespace(port=-1, address="127.0.0.1"))
