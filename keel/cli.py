"""The `keel` command. Parses arguments and hands each subcommand to the package that owns
it, imported only when that subcommand runs (so `keel --help` imports no torch or simpy).

Exit codes: 0 success, 1 the run failed, 2 bad input (one line naming what was wrong).
`--json` prints one JSON object on stdout and nothing else there; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from keel.errors import InputError, RunFailed
from keel.paths import DEFAULT_SCENARIO


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: exit 2 with one line
        self.exit(2, f"keel: {message} (see {self.prog} --help)\n")


def _handler(target: str) -> Callable[[argparse.Namespace], int]:
    module, _, func = target.partition(":")

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), func)(args)
    return run


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" outside one."""
    import importlib.metadata as md
    try:
        return md.version("keel")
    except md.PackageNotFoundError:
        return "unknown"


def _seed(text: str) -> int:
    """A seed: a non-negative integer (numpy's generators take no other)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags. Long on purpose: one flat declaration per subcommand,
    read top to bottom like the CLI contract in ARCHITECTURE.md; no logic lives here."""
    p = _Parser(prog="keel", description="Digital twin, planner and resilient runtime for multi-region training.")
    p.add_argument("--version", action="version", version=f"keel {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def scenario_args(sp: argparse.ArgumentParser, required: bool = True) -> None:
        sp.add_argument("scenario", nargs=None if required else "?", default=None if required else str(DEFAULT_SCENARIO),
                        help="scenario TOML file")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario key, e.g. regions.2.nodes=10 (repeatable)")

    sp = sub.add_parser("simulate", help="predict a run with the twin")
    scenario_args(sp)
    sp.add_argument("--replicas", type=int, default=1, help="seeded Monte-Carlo replicas")
    sp.add_argument("--seed", type=_seed, default=None, help="seed, a non-negative integer (default: run.seed)")
    sp.add_argument("--calibration", default=None, help="calibration.json from keel calibrate")
    sp.add_argument("--out", default=None, help="output directory (events.jsonl, summary.json)")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    sp.set_defaults(func=_handler("twin.cli:simulate"))

    sp = sub.add_parser("run", help="run the scenario for real on the torch.distributed runtime")
    scenario_args(sp)
    sp.add_argument("--steps", type=int, default=None, help="override run.steps")
    sp.add_argument("--out", default=None, help="output directory")
    sp.add_argument("--resume", default=None, help="resume from the newest complete checkpoint in DIR")
    sp.add_argument("--allow-config-change", action="store_true", help="resume even if the config hash differs")
    sp.add_argument("--no-faults", action="store_true", help="ignore faults.schedule")
    sp.add_argument("--emulate", action="store_true",
                    help="emulate the scenario's cluster on this machine (emulation.enabled = true): "
                         "one worker per node, the scenario's compute, network, storage and detection times")
    sp.add_argument("--time-scale", type=float, default=None, metavar="X",
                    help="wall seconds per emulated second (emulation.time_scale; default: the scenario's)")
    sp.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="join a coordinator running elsewhere")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=_handler("runtime.cli:run"))

    sp = sub.add_parser("data", help="the versioned dataset")
    dsub = sp.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dp = dsub.add_parser("prepare", help="build the dataset (content-hashed shards)")
    dp.add_argument("--out", default=None, help="dataset directory")
    dp.add_argument("--shards", type=int, default=16)
    dp.add_argument("--json", action="store_true")
    dp.set_defaults(func=_handler("runtime.cli_data:data_prepare"))

    sp = sub.add_parser("calibrate", help="measure what is real in an emulated run of the scenario, for the twin")
    scenario_args(sp, required=False)
    sp.add_argument("--out", default="calibration.json", help="the calibration file to write (default: %(default)s)")
    sp.add_argument("--quick", action="store_true", help="fewer emulated runs (2 instead of 3)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=_handler("planner.cli:calibrate"))

    sp = sub.add_parser("validate", help="twin vs runtime on one fault schedule")
    scenario_args(sp)
    sp.add_argument("--calibration", default=None)
    sp.add_argument("--out", default=None)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=_handler("planner.cli:validate"))

    sp = sub.add_parser("plan", help="search recovery policies on the twin")
    scenario_args(sp)
    sp.add_argument("--trials", type=int, default=60)
    sp.add_argument("--replicas", type=int, default=8)
    sp.add_argument("--ray", default=None, metavar="ADDRESS")
    sp.add_argument("--calibration", default=None, help="calibration.json from keel calibrate")
    sp.add_argument("--validate", action="store_true")
    sp.add_argument("--out", default=None)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=_handler("planner.cli:plan"))

    sp = sub.add_parser("ckpt", help="verify or inspect a checkpoint (reference reader)")
    csub = sp.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    cp = csub.add_parser("verify")
    cp.add_argument("path")
    cp.add_argument("--json", action="store_true")
    cp.set_defaults(func=_handler("keel.ckpt_reader:cli_verify"))
    cp = csub.add_parser("inspect")
    cp.add_argument("path")
    cp.add_argument("--json", action="store_true")
    cp.set_defaults(func=_handler("keel.ckpt_reader:cli_inspect"))

    sp = sub.add_parser("report", help="a static HTML report of a run directory")
    sp.add_argument("dir")
    sp.add_argument("--html", default=None)
    sp.set_defaults(func=_handler("app.report:cli"))

    sp = sub.add_parser("app", help="start the dashboard")
    sp.add_argument("--port", type=int, default=8501)
    sp.add_argument("--address", default="127.0.0.1")
    sp.add_argument("--runs", default=None, metavar="DIR", help="runs directory (default: $KEEL_RUNS or ./runs)")
    sp.set_defaults(func=_handler("app.launch:cli"))

    sp = sub.add_parser("scenario", help="print a scenario resolved (defaults and --set applied), or the schema")
    scenario_args(sp, required=False)
    sp.add_argument("--schema", action="store_true", help="list every key with its default")
    sp.set_defaults(func=_handler("keel.scenario:cli_show"))

    sp = sub.add_parser("demo", help="the main job on the embedded default scenario")
    sp.add_argument("--out", default="runs/demo")
    sp.set_defaults(func=_handler("keel.demo:cli"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose flags these are not
        words = [w for w in (args.command, getattr(args, "data_command", None), getattr(args, "ckpt_command", None)) if w]
        _Parser(prog=" ".join(["keel", *words])).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "scenario", None) is not None:
            # Every command that takes a scenario gets it checked here first, so bad input
            # fails in one place, with one message, before any heavy import.
            from keel import scenario
            args.loaded = scenario.load(args.scenario, args.overrides)
        code = args.func(args)
    except InputError as e:
        print(f"keel: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"keel: run failed: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout closed early (`keel ... | head`): not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
