"""A multi-host test bed on one machine: hosts are network namespaces, each with its own stack
and address, joined by a bridge; hosts are cut off and healed for real.

    with HostBed(5) as bed:                      # hosts h0..h4, addresses 198.18.0.1..5
        coord = bed.popen(0, ["python", "-m", "runtime.coordinator", ...])
        bed.cut(3)                               # h3's bridge port down: its packets vanish
        bed.cut_region([3, 4]) / bed.cut_oneway(1, 2) / bed.heal()

Layout: a namespace of the bed's own ("switch") holds the bridge; each host's namespace has a
veth `eth0` whose peer is a port of that bridge. Nothing is created in the machine's own
network namespace, and only addresses of 198.18.0.0/15 (RFC 2544, benchmark networks) are used,
inside these namespaces: nothing can leave the machine. Deleting the namespaces deletes every
veth and the bridge with them.

Cuts: `cut(h)` takes h's bridge port down (the host's own link stays up: packets are dropped
silently, no reset, its processes keep running); `cut_region(hs)` cuts hosts off from every
host outside `hs` (nftables in the switch: the region's hosts still reach one another);
`cut_oneway(a, b)` drops b's packets to a only (a's still reach b; nftables). `heal()` undoes all.

Teardown is guaranteed: a context manager, an atexit hook and SIGTERM/SIGINT/SIGHUP handlers
kill every process in the bed's namespaces and delete them; a bed whose owner died without
that (SIGKILL) is swept by the next bed made on this machine (`sweep_stale`). Names start with
`kb<owner pid>`, so concurrent runs never collide. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN):
`unavailable()` says why a bed cannot be made here, for a test's skip reason.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from keel.rundir import pid_alive

NET = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "kb"            # every namespace of a bed is named kb<pid>[.<n>]-<role>
_NAME = re.compile(rf"^{PREFIX}(\d+)(?:\.\d+)?-")
_LIVE: list["HostBed"] = []
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_previous: dict[int, object] = {}
_counter = [0]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why a bed cannot be made here (None when it can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as .ci/run does)"
    name = f"{PREFIX}{os.getpid()}.probe-{time.monotonic_ns() % 100000}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def nft_unavailable() -> str | None:
    return None if shutil.which("nft") else "nftables (`nft`) is not installed: apt-get install nftables"


def bed_namespaces() -> list[str]:
    """Every namespace on this machine that a bed made (alive or not)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line and _NAME.match(line.split()[0])]


def _kill_and_delete(namespaces: Sequence[str]) -> None:
    """SIGKILL every process in these namespaces, then delete them (their veths and bridge go)."""
    for _ in range(50):
        pids = []
        for ns in namespaces:
            out = _ip("netns", "pids", ns, check=False).stdout
            pids += [int(p) for p in out.split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of beds whose owner process is gone (killed before its teardown
    ran); the names swept."""
    stale = [ns for ns in bed_namespaces() if not pid_alive(int(_NAME.match(ns).group(1)))]
    _kill_and_delete(stale)
    return stale


def _on_signal(signum, frame):  # noqa: ARG001
    for bed in list(_LIVE):
        bed.close()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    if _previous:
        return
    atexit.register(lambda: [bed.close() for bed in list(_LIVE)])
    for sig in _SIGNALS:
        try:
            _previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread: atexit and sweep_stale still hold
            pass


class HostBed:
    """N hosts, h0..h{N-1}, addresses 198.18.<k>.1.. on one /24 of 198.18.0.0/15."""

    def __init__(self, hosts: int, subnet: int | None = None):
        if not 2 <= hosts <= 200:
            raise ValueError(f"hosts: {hosts}; a bed has 2 to 200 hosts")
        sweep_stale()
        _install_handlers()
        _counter[0] += 1
        self.tag = f"{PREFIX}{os.getpid()}.{_counter[0]}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        k = (os.getpid() + _counter[0]) % 256 if subnet is None else subnet
        base = ipaddress.ip_network(f"198.18.{k}.0/24")
        assert base.subnet_of(NET)
        self.addresses = [str(base.network_address + i + 1) for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        self._nft = False
        _LIVE.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------- building

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            port = self.port(i)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def port(self, host: int) -> str:
        return f"p{host}"

    def __len__(self) -> int:
        return len(self.names)

    def __enter__(self) -> "HostBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------- running

    def argv(self, host: int, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def run(self, host: int, cmd: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, cmd), capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, host: int, cmd: Sequence[str], log: Path | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` on `host` in a session of its own; its output to `log` (or inherited)."""
        if log is not None:
            fh = open(log, "ab")
            kw.setdefault("stdout", fh)
            kw.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen(self.argv(host, cmd), start_new_session=True, **kw)
        if log is not None:
            fh.close()
        self.procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    # ------------------------------------------------------------------------- cuts

    def cut(self, host: int) -> None:
        """Host `host` off the network: its bridge port down (silent drop, both ways)."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")

    def cut_region(self, hosts: Sequence[int]) -> None:
        """The hosts in `hosts` reach one another but nothing outside them, nor it them."""
        inside = " ".join(f'"{self.port(h)}",' for h in hosts).rstrip(",")
        self._nft_rules([f"iifname {{ {inside} }} oifname != {{ {inside} }} drop",
                         f"oifname {{ {inside} }} iifname != {{ {inside} }} drop"])

    def cut_oneway(self, reaches: int, silent: int) -> None:
        """`reaches`'s packets still get to `silent`; `silent`'s to `reaches` are dropped."""
        self._nft_rules([f'iifname "{self.port(silent)}" oifname "{self.port(reaches)}" drop'])

    def _nft_rules(self, rules: list[str]) -> None:
        why = nft_unavailable()
        if why:
            raise RuntimeError(why)
        text = ""
        if not self._nft:
            text = "table bridge keelcut {\n chain cuts { type filter hook forward priority 0; policy accept; }\n}\n"
        text += "".join(f"add rule bridge keelcut cuts {r}\n" for r in rules)
        subprocess.run(["ip", "netns", "exec", self.switch, "nft", "-f", "-"], input=text, text=True,
                       check=True, capture_output=True, timeout=30)
        self._nft = True

    def heal(self) -> None:
        """Every cut undone: all bridge ports up, the nftables rules gone."""
        for i in range(len(self.names)):
            _ip("-n", self.switch, "link", "set", self.port(i), "up")
        if self._nft:
            subprocess.run(["ip", "netns", "exec", self.switch, "nft", "delete", "table", "bridge", "keelcut"],
                           capture_output=True, timeout=30)
            self._nft = False

    # ------------------------------------------------------------------------- teardown

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:  # the process groups started here (a process may have left its netns' view)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _kill_and_delete([*self.names, self.switch])
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self in _LIVE:
            _LIVE.remove(self)

    def leftovers(self) -> list[str]:
        """What of this bed is still on the machine (empty after close)."""
        left = [ns for ns in bed_namespaces() if ns.startswith(self.tag + "-")]
        left += [f"pid {p.pid}" for p in self.procs if p.poll() is None]
        return left
