"""The `keel` command. Parses arguments and hands each subcommand to the package that owns
it, imported only when that subcommand runs (so `keel --help` imports no torch or simpy).

Exit codes: 0 success, 1 the run failed, 2 bad input (one line naming what was wrong).
`--json` prints one JSON object on stdout and nothing else there; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import importlib
import math
import signal
import sys
from typing import Callable, Sequence

from keel.errors import InputError, RunFailed
from keel.paths import DEFAULT_NAME, resolve_scenario, scenario_names


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
        return md.version("keel-twin")
    except md.PackageNotFoundError:
        return "unknown"


def _int_from(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`, called `what` in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_seed = _int_from(0, "a non-negative integer")   # numpy's generators take no other seed
_count = _int_from(1, "a positive integer")      # replicas, trials, steps, shards


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port between 1 and 65535, got {text!r}")
    return value


def _time_scale(text: str) -> float | str:
    """Wall seconds per emulated second: a positive, finite number, or "auto" (measured here)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of wall seconds per emulated second "
                                         f"or auto, got {text!r}")
    return value


class _Help(argparse.HelpFormatter):
    """Help with the default of every option that has one worth showing: `(default: X)` where
    the help does not already say it, never for flags or for options whose default is "unset"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.default == [] or action.nargs == 0):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags. Long on purpose: one flat declaration per subcommand,
    read top to bottom like the CLI contract in docs/design.md; no logic lives here."""
    p = _Parser(prog="keel", formatter_class=_Help,
                description="Digital twin, planner and resilient runtime for multi-region training.",
                epilog="Exit codes: 0 success, 1 the run failed, 2 bad input (one line naming it). "
                       "`keel COMMAND --help` lists a command's options.")
    p.add_argument("--version", action="version", version=f"keel {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".", formatter_class=_Help)

    def scenario_args(sp: argparse.ArgumentParser, required: bool = True) -> None:
        packaged = ", ".join(scenario_names())
        if required:
            sp.add_argument("scenario", help=f"scenario TOML file, or a packaged scenario's name ({packaged})")
        else:
            sp.add_argument("scenario", nargs="?", default=DEFAULT_NAME,
                            help=f"scenario TOML file, or a packaged scenario's name ({packaged}) "
                                 "(default: %(default)s)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario key, e.g. regions.2.nodes=10 (repeatable; "
                             "`keel scenario --schema` lists the keys)")

    def json_flag(sp: argparse.ArgumentParser, what: str = "the summary") -> None:
        sp.add_argument("--json", action="store_true",
                        help=f"print {what} as one JSON object on stdout (progress stays on stderr)")

    sp = command("simulate", "predict a run with the twin")
    scenario_args(sp, required=False)
    sp.add_argument("--replicas", type=_count, default=1, metavar="N",
                    help="seeded Monte-Carlo replicas; above 1: the mean goodput with its 95%% CI")
    sp.add_argument("--seed", type=_seed, default=None, metavar="N",
                    help="seed, a non-negative integer (default: the scenario's run.seed)")
    sp.add_argument("--calibration", default=None, metavar="FILE",
                    help="calibration.json from keel calibrate (default: the twin's built-in figures)")
    sp.add_argument("--out", default=None, metavar="DIR",
                    help="write events.jsonl and summary.json there (default: write nothing)")
    json_flag(sp)
    sp.set_defaults(func=_handler("twin.cli:simulate"))

    sp = command("run", "run the scenario for real on the torch.distributed runtime")
    scenario_args(sp)
    sp.add_argument("--steps", type=_count, default=None, metavar="N", help="steps to run (default: run.steps)")
    sp.add_argument("--out", default=None, metavar="DIR",
                    help="run directory (default: the --resume DIR, else runs/RUN_NAME/TIMESTAMP)")
    sp.add_argument("--resume", default=None, metavar="DIR",
                    help="resume from the newest complete checkpoint in DIR (default: start afresh)")
    sp.add_argument("--allow-config-change", action="store_true",
                    help="resume even if the scenario's config hash differs from the checkpoint's")
    sp.add_argument("--no-faults", action="store_true", help="inject none of faults.schedule")
    sp.add_argument("--emulate", action="store_true",
                    help="emulate the scenario's cluster on this machine (emulation.enabled = true): "
                         "one worker per node, the scenario's compute, network, storage and detection times")
    sp.add_argument("--time-scale", type=_time_scale, default=None, metavar="X",
                    help="wall seconds per emulated second, with --emulate, or auto: the smallest this "
                         "machine keeps, measured before the run (default: the scenario's emulation.time_scale)")
    sp.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="join a coordinator running elsewhere as one worker (default: be the coordinator "
                         "and start every worker here)")
    json_flag(sp)
    sp.set_defaults(func=_handler("runtime.cli:run"))

    sp = command("profile", "measure the scenario's job on this machine's device, for the twin")
    scenario_args(sp)
    sp.add_argument("--steps", type=_count, default=3, metavar="N", help="steps to train and time")
    sp.add_argument("--write", default=None, metavar="FILE",
                    help="write the scenario with the measured workload and checkpoint values to FILE "
                         "(default: write nothing)")
    json_flag(sp, "the measurements")
    sp.set_defaults(func=_handler("runtime.profile:main"))

    sp = command("data", "the versioned dataset")
    dsub = sp.add_subparsers(dest="data_command", required=True, parser_class=_Parser, metavar="COMMAND")
    dp = dsub.add_parser("prepare", help="build (or verify) the dataset: content-hashed shards",
                         description="Build (or verify) the versioned dataset: content-hashed shards.",
                         formatter_class=_Help)
    dp.add_argument("--out", default=None, metavar="DIR",
                    help="dataset directory (default: $KEEL_DATA_DIR, else data/, one folder per shard count)")
    dp.add_argument("--shards", type=_count, default=16, metavar="N", help="shards to cut the dataset into")
    json_flag(dp)
    dp.set_defaults(func=_handler("runtime.cli_data:data_prepare"))

    sp = command("calibrate", "measure what is real in an emulated run of the scenario, for the twin")
    scenario_args(sp, required=False)
    sp.add_argument("--out", default="calibration.json", metavar="FILE", help="the calibration file to write")
    sp.add_argument("--quick", action="store_true", help="fewer emulated runs (2 instead of 3)")
    json_flag(sp, "the calibration")
    sp.set_defaults(func=_handler("planner.cli:calibrate"))

    sp = command("validate", "twin vs the emulated runtime on one fault schedule, judged against the "
                             "scenario's tolerances")
    scenario_args(sp, required=False)
    sp.add_argument("--calibration", default=None, metavar="FILE",
                    help="calibration.json from keel calibrate (default: the one in the output directory, "
                         "else measure one first)")
    sp.add_argument("--out", default=None, metavar="DIR",
                    help="output directory (default: runs/validate-RUN_NAME)")
    json_flag(sp, "the comparison")
    sp.set_defaults(func=_handler("planner.cli:validate"))

    sp = command("plan", "search recovery policies on the twin")
    scenario_args(sp, required=False)
    sp.add_argument("--trials", type=_count, default=60, metavar="N", help="policies the search tries")
    sp.add_argument("--replicas", type=_count, default=8, metavar="N", help="twin replicas per policy")
    sp.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="run the replicas as Ray tasks: 'local' or HOST:PORT (default: in this process)")
    sp.add_argument("--calibration", default=None, metavar="FILE",
                    help="calibration.json from keel calibrate (default: the twin's built-in figures)")
    sp.add_argument("--validate", action="store_true",
                    help="run the recommended policy and the baseline on the runtime (local scenarios only)")
    sp.add_argument("--out", default=None, metavar="DIR", help="write DIR/plan.json (default: write nothing)")
    json_flag(sp, "the plan")
    sp.set_defaults(func=_handler("planner.cli:plan"))

    sp = command("ckpt", "verify or inspect a checkpoint (reference reader)")
    csub = sp.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name, what in (("verify", "check a checkpoint's manifest and checksums"),
                       ("inspect", "list a checkpoint's fields")):
        cp = csub.add_parser(name, help=what, description=what[:1].upper() + what[1:] + ".", formatter_class=_Help)
        cp.add_argument("path", help="a checkpoint folder (step-NNNNNNNN), or a folder of them")
        json_flag(cp, "the result")
        cp.set_defaults(func=_handler(f"keel.ckpt_reader:cli_{name}"))

    sp = command("report", "a static HTML report of a run directory")
    sp.add_argument("dir", help="a directory keel simulate, run, validate or plan wrote (their --out)")
    sp.add_argument("--html", default=None, metavar="FILE", help="the report to write (default: DIR/report.html)")
    sp.set_defaults(func=_handler("app.report:cli"))

    sp = command("app", "start the dashboard")
    sp.add_argument("--port", type=_port, default=8501, metavar="N", help="TCP port to serve on")
    sp.add_argument("--address", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    sp.add_argument("--runs", default=None, metavar="DIR", help="runs directory (default: $KEEL_RUNS or ./runs)")
    sp.set_defaults(func=_handler("app.launch:cli"))

    sp = command("scenario", "print a scenario resolved (defaults and --set applied), or the schema")
    scenario_args(sp, required=False)
    sp.add_argument("--schema", action="store_true", help="list every key with its default and meaning")
    sp.set_defaults(func=_handler("keel.scenario:cli_show"))

    sp = command("demo", "the main job on the packaged default scenario: simulate, plan, run, validate")
    sp.add_argument("--out", default="runs/demo", metavar="DIR", help="where every stage writes its outputs")
    sp.set_defaults(func=_handler("keel.demo:cli"))
    return p


class Stopped(KeyboardInterrupt):
    """A signal that stops a command (SIGINT, SIGTERM, SIGHUP), raised where the command is, so
    that its cleanup runs (`finally`: a run stops every process it started). `note` is what the
    command adds to the one line it ends with (a run: its checkpoint and how to resume)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.note = ""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(signum: int, frame) -> None:
    for s in STOP_SIGNALS:  # the cleanup that follows runs once, not interrupted by the next signal
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


def _answer_signals() -> dict[int, object]:
    """SIGTERM (Slurm, Kubernetes, systemd) and SIGHUP (a closed terminal) stop a command as
    Ctrl-C does; a signal ignored when keel started (nohup) stays ignored. The handlers it
    replaced (none outside the main thread, where Python allows no handler)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    saved = {}
    for s in STOP_SIGNALS:
        previous = signal.getsignal(s)
        if previous is not signal.SIG_IGN:
            saved[s] = previous
            signal.signal(s, _stop)
    return saved


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `keel` command line; returns its exit code (argparse's own exits included:
    2 for a bad flag, 0 for --help and --version; 128 + N when signal N stopped it)."""
    saved = _answer_signals()
    try:
        return _main(argv)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand whose flags these are not
            words = [w for w in (args.command, getattr(args, "data_command", None),
                                 getattr(args, "ckpt_command", None)) if w]
            _Parser(prog=" ".join(["keel", *words])).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (a stopped run's resume command)
    try:
        if getattr(args, "scenario", None) is not None:
            # Every command that takes a scenario gets it checked here first, so bad input
            # fails in one place, with one message, before any heavy import.
            from keel import scenario
            path = resolve_scenario(args.scenario)
            if not path.exists():
                raise scenario.ScenarioError(f"{path}: no such scenario file, nor a packaged scenario "
                                             f"({', '.join(scenario_names())})")
            args.scenario = str(path)
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
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        note = getattr(e, "note", "")
        lead = "\n" if sys.stderr.isatty() else ""  # after a progress bar's unfinished line
        print(f"{lead}keel: stopped by {signal.Signals(signum).name}{'; ' + note if note else ''}", file=sys.stderr)
        return 128 + signum
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
