"""The supervisor: what `keel run` is while its job runs. It holds what must outlive a
coordinator (the control port, the rendezvous store, the worker processes, the job's secret)
and runs the coordinator as a child process, which it replaces when it dies or hangs (by a
standby started beforehand, its modules imported: no interpreter start in the way).

    keel run: supervisor (this module): control port, TCPStore, fork server, the workers' parent
      coordinator (python -m runtime.coordinator --supervised FD): decisions, events.jsonl,
                  coordinator.json (runtime/coordinator/snapshot.py)

The two talk over a socketpair in JSON lines (runtime.protocol.Channel):
  coordinator -> supervisor: hb, spawn {node, fresh}, result {summary}, failed {error, message}
  supervisor -> coordinator: init {...}, spawned {node, pid}, exited {pid, rc}

A coordinator that exits without a verdict (killed, crashed), or says nothing for `hang_s`
(then SIGKILLed), is replaced by a successor on the same port, store and workers, which
recovers the run from its directory; the workers rejoin it (runtime/worker_link.py). After
`restarts` replacements the run fails. When the run ends, every worker still alive is
stopped: no process outlives `keel run`.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from keel.errors import InputError, RunFailed
from keel.rundir import lock_run_dirs
from keel.net import is_loopback
from keel.paths import REPO_ROOT
from keel.scenario import Scenario
from runtime.coordinator.procs import LocalProcess, start_worker
from runtime.protocol import SECRET_ENV, Channel, env_secret, new_secret, parse_address, silence_s

RESTARTS = 3            # successors a run may need before it fails
RESTARTS_ENV = "KEEL_COORDINATOR_RESTARTS"
HB_S = 0.5              # the coordinator says hb this often
POLL_S = 0.02


def restarts_allowed() -> int:
    try:
        n = int(os.environ.get(RESTARTS_ENV, RESTARTS))
    except ValueError:
        return RESTARTS
    return max(0, n)


class Supervisor:
    def __init__(self, scenario: Scenario, out_dir: str | Path, *, listen: str = "127.0.0.1:0",
                 spawn: bool = True, options: dict[str, Any] | None = None):
        """`options`: the Coordinator's keyword arguments that travel to it (resume, no_faults,
        allow_config_change, progress, hangs, device, backend, data_root, job_dir)."""
        self.sc = scenario
        self.out = Path(out_dir)
        self.spawn_local = spawn
        self.options = dict(options or {})
        self.secret = env_secret() or (new_secret() if self.spawn_local else None)
        if self.secret is None:
            raise InputError("KEEL_JOB_SECRET: not set; a coordinator whose workers start elsewhere needs the "
                             "job's secret, the same for it and every worker (e.g. export KEEL_JOB_SECRET="
                             "$(python3 -c 'import secrets; print(secrets.token_hex(32))'))")
        self.locks = lock_run_dirs(self.out, self.options.get("resume"))  # before anything is written or started
        try:
            self._setup(listen)
        except BaseException:
            self.close()
            raise

    def _setup(self, listen: str) -> None:
        self.coord: subprocess.Popen | None = None
        self.link: Channel | None = None
        self.standby: tuple[subprocess.Popen, Channel] | None = None  # the next coordinator, waiting
        self.procs: dict[int, tuple[str, LocalProcess]] = {}  # pid -> (node, process) for workers started here
        self.host, port = parse_address(listen)
        self._listen(port)
        self.restarts = restarts_allowed()
        self.hang_s = max(2.0, silence_s() / 3)  # a successor must be up before the workers give up
        self.exited: dict[int, int | None] = {}
        self.deaths: list[dict[str, Any]] = []  # every coordinator death: n, when noticed, how
        self.dying = ""  # what the coordinator said it is killed by (a scheduled coordinator_loss)
        self.incarnation = 0

    def _listen(self, port: int) -> None:
        """The control port and the rendezvous store, both bound to `self.host` only (torch's
        TCPStore alone would listen on every interface: it is handed a socket bound here).
        Beyond loopback, a warning names what is exposed."""
        import torch.distributed as dist
        try:
            self.listener = socket.create_server((self.host, port), backlog=256)
            store_sock = socket.create_server((self.host, 0), backlog=256)
        except OSError as e:
            raise InputError(f"--listen {self.host}:{port}: cannot listen there ({e.strerror or e})") from None
        self.port = self.listener.getsockname()[1]
        self.store_port = store_sock.getsockname()[1]
        self.store = dist.TCPStore(self.host, self.store_port, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=300), master_listen_fd=store_sock.detach())
        if not is_loopback(self.host):
            print(f"keel: warning: listening beyond this machine on {self.host}: the coordinator's port {self.port} "
                  f"(workers must prove the job's secret) and the rendezvous store's port {self.store_port} "
                  f"(torch's TCPStore: no authentication); firewall them to the job's machines",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------- the coordinator

    def _launch(self) -> tuple[subprocess.Popen, Channel]:
        """A coordinator process, its modules imported, waiting for its `init`."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env[SECRET_ENV] = self.secret
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "runtime.coordinator", "--supervised", str(theirs.fileno()),
               "--listener-fd", str(self.listener.fileno())]
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), self.listener.fileno()), env=env,
                                stdin=subprocess.DEVNULL)
        theirs.close()
        link = Channel(ours)
        link.sock.setblocking(False)
        return proc, link

    def _start_coordinator(self, recover: dict[str, Any] | None) -> None:
        """Start the coordinator: the standby if there is one (a successor then costs no
        interpreter start), and a new standby behind it while restarts are left."""
        if self.standby is not None and self.standby[0].poll() is None:
            self.coord, self.link = self.standby
        else:
            self.coord, self.link = self._launch()
        self.link.send({"type": "init", "scenario": self.sc.plain(), "source": self.sc.source,
                        "out_dir": str(self.out), "spawn": self.spawn_local, "host": self.host, "port": self.port,
                        "store_port": self.store_port, "options": self.options, "recover": recover,
                        "incarnation": self.incarnation})
        self.heard: float | None = None  # the hang watch starts with its first message
        self.standby = self._launch() if self.incarnation < self.restarts else None

    def run(self) -> dict[str, Any]:
        """Run the job to its end; the coordinator's summary. Raises RunFailed or InputError
        as the coordinator did, or RunFailed when it died more than `restarts` times."""
        try:
            self._start_coordinator(None)
            while True:
                verdict = self._serve()
                if verdict is not None:
                    return self._verdict(verdict)
                self._replace()
        finally:
            self._stop_all()

    def _serve(self) -> dict[str, Any] | None:
        """Serve the coordinator until it exits; its verdict, or None if it died without one."""
        verdict = None
        while True:
            msgs = self.link.recv_ready() if self.link is not None else None
            if msgs is None:  # its end of the link closed: it exited (or is about to)
                if self.link is not None:
                    self.link.close()
                    self.link = None
            else:
                for msg in msgs:
                    verdict = self._on_message(msg) or verdict
            self._reap()
            rc = self.coord.poll()
            if rc is not None:
                if self.link is not None:  # what it said before it died (no worker is started for it now)
                    for msg in self.link.recv_ready() or []:
                        if msg.get("type") != "spawn":
                            verdict = self._on_message(msg) or verdict
                self.died_how = f"exit code {rc}" if rc >= 0 else f"signal {signal.Signals(-rc).name}"
                return verdict
            if verdict is None and self.heard is not None and time.monotonic() - self.heard > self.hang_s:
                print(f"keel: the coordinator (pid {self.coord.pid}) said nothing for {self.hang_s:g} s; "
                      f"killing it", file=sys.stderr, flush=True)
                self.coord.kill()
                self.coord.wait()
                self.died_how = f"hung (silent {self.hang_s:g} s)"
                return None
            if msgs == [] or msgs is None:
                time.sleep(POLL_S)

    def _on_message(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Handle one message from the coordinator; the run's verdict if it is one."""
        self.heard = time.monotonic()
        kind = msg.get("type")
        if kind == "spawn":
            self._spawn(str(msg["node"]), bool(msg.get("fresh")))
        elif kind == "dying":  # an injected loss: say so, not only that it died
            self.dying = str(msg.get("why", ""))
        return msg if kind in ("result", "failed") else None

    def _replace(self) -> None:
        noticed = time.monotonic()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.incarnation >= self.restarts:
            raise RunFailed(f"the coordinator died ({self.died_how}) after {self.restarts} restart(s); "
                            f"keel run --resume {self.out} continues from the newest checkpoint")
        self.incarnation += 1
        why = f"was killed by {self.dying}" if self.dying else f"died ({self.died_how})"
        self.dying = ""
        print(f"keel: the coordinator {why}; starting its successor "
              f"({self.incarnation} of at most {self.restarts})", file=sys.stderr, flush=True)
        self._reap()
        live = {node: pid for pid, (node, p) in self.procs.items() if pid not in self.exited}
        # all of them: a successor that dies before it has logged its predecessor's death
        # leaves that to the next (snapshot.py keeps which it has logged)
        self.deaths.append({"n": len(self.deaths), "noticed": noticed, "how": self.died_how})
        self._start_coordinator({"deaths": self.deaths, "workers": live,
                                 "exited": {str(pid): rc for pid, rc in self.exited.items()}})

    def _verdict(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["type"] == "result":
            return msg["summary"]
        if msg.get("error") == "InputError":
            raise InputError(msg.get("message", ""))
        raise RunFailed(msg.get("message", ""))

    # ------------------------------------------------------------------------- workers

    def _spawn(self, node: str, fresh: bool) -> None:
        log_path = self.out / "logs" / (node.replace("/", "_") + ".log")
        proc = start_worker(node, f"{self.host}:{self.port}", log_path, self.secret, fresh)
        self.procs[proc.pid] = (node, proc)
        if self.link is not None:
            self.link.send({"type": "spawned", "node": node, "pid": proc.pid})

    def _reap(self) -> None:
        for pid, (_, proc) in self.procs.items():
            if pid not in self.exited:
                rc = proc.poll()
                if rc is not None:
                    self.exited[pid] = rc
                    if self.link is not None:
                        self.link.send({"type": "exited", "pid": pid, "rc": rc})

    def _stop_all(self) -> None:
        """Nothing outlives the run: the coordinator and its standby, then every worker still alive."""
        for proc, link in ((self.coord, self.link), self.standby or (None, None)):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if link is not None:
                link.close()
        for pid, (_, proc) in self.procs.items():
            if proc.poll() is None:
                proc.signal(signal.SIGKILL)
        for _, proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.listener.close()
        except (OSError, AttributeError):
            pass

    def close(self) -> None:
        """Release the run directory (after the summary is written: the run is over)."""
        for lock in self.locks:
            lock.close()
