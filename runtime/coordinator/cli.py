"""The coordinator's entry points: `python -m runtime.coordinator` by hand (a coordinator under
its own supervisor, for workers started elsewhere) and as a supervisor's child."""
from __future__ import annotations

import sys

from keel.errors import InputError, RunFailed

from runtime.coordinator.core import Coordinator
from runtime.protocol import Channel


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.coordinator SCENARIO --listen HOST:PORT --out DIR`: a coordinator
    (under its supervisor, which restarts it) that waits for workers started elsewhere (by hand
    or by torchrun). It and its workers share the job's secret through KEEL_JOB_SECRET
    (runtime/protocol.py)."""
    import argparse

    from keel.rundir import write_summary
    from keel.scenario import load
    from runtime.supervisor import Supervisor
    p = argparse.ArgumentParser(prog="python -m runtime.coordinator")
    p.add_argument("scenario", help="scenario TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key (repeatable)")
    p.add_argument("--listen", default="127.0.0.1:29400", metavar="HOST:PORT",
                   help="where the coordinator and its rendezvous store listen (default: %(default)s, this "
                        "machine only; another address prints a warning naming what is exposed)")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--no-faults", action="store_true", help="ignore faults.schedule")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR from its newest checkpoint (docs/multihost.md)")
    args = p.parse_args(argv)
    from runtime.api import job_dir_of
    try:
        sc = load(args.scenario, args.overrides)
        if args.resume:
            from keel.durable import check_resume_dir
            check_resume_dir(args.resume)
        sup = Supervisor(sc, args.out, listen=args.listen, spawn=False, options={"no_faults": args.no_faults, "resume": args.resume,
                                                                                 "job_dir": job_dir_of(sc)})
        print(f"coordinator listening on {sup.host}:{sup.port}", file=sys.stderr, flush=True)
        summary = sup.run()
    except InputError as e:
        print(f"keel: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"keel: run failed: {e}", file=sys.stderr)
        return 1
    write_summary(args.out, summary)
    return 0


def supervised_main(argv: list[str]) -> int:
    """`python -m runtime.coordinator --supervised FD --listener-fd FD`: the coordinator as its
    supervisor starts it; the run's verdict goes back over the link (runtime/supervisor.py)."""
    import socket

    from keel.scenario import from_dict
    link = Channel(socket.socket(fileno=int(argv[2])))
    init = link.recv()
    if init is None or init.get("type") != "init":
        return 2
    try:
        sc = from_dict(init["scenario"], source=init["source"])
        coord = Coordinator(sc, init["out_dir"], link=link, host=init["host"], spawn=init["spawn"],
                            endpoints={"listener_fd": int(argv[4]), "store_port": init["store_port"]},
                            recover=init["recover"], incarnation=init["incarnation"], **init["options"])
        summary = coord.run()
        verdict = {"type": "result", "summary": summary}
    except InputError as e:
        verdict = {"type": "failed", "error": "InputError", "message": str(e)}
    except RunFailed as e:
        verdict = {"type": "failed", "error": "RunFailed", "message": str(e)}
    except KeyboardInterrupt:
        return 130
    except Exception:  # a bug, not a death: a successor would meet it again
        import traceback
        verdict = {"type": "failed", "error": "RunFailed", "message": "the coordinator failed:\n" + traceback.format_exc()}
    link.sock.setblocking(True)
    link.send(verdict)
    return 0

