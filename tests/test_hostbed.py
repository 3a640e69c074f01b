"""The multi-host test bed (tests/hostbed.py): hosts reach one another on their own addresses,
cuts drop what they say and heal, and nothing is left behind: not after a clean exit, not
after a test interrupted halfway (SIGTERM, SIGINT), not after one killed outright (SIGKILL:
the next bed sweeps it)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hostbed

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(hostbed.unavailable() is not None, reason=str(hostbed.unavailable()))]

HERE = Path(__file__).resolve().parent
PROBE = """
import socket, sys
if sys.argv[1] == "serve":
    s = socket.create_server((sys.argv[2], 7000))
    while True:
        s.accept()[0].close()
try:
    socket.create_connection((sys.argv[2], 7000), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError:
    print("no")
"""


def _reaches(bed: hostbed.HostBed, a: int, b: int, timeout: float = 0.5) -> bool:
    return bed.run(a, [sys.executable, "-c", PROBE, "dial", bed.addresses[b], str(timeout)]).stdout.strip() == "ok"


def test_hosts_reach_each_other_and_cuts_drop_and_heal():
    with hostbed.HostBed(4) as bed:
        assert all(hostbed.NET.supernet_of(__import__("ipaddress").ip_network(a + "/32")) for a in bed.addresses)
        for h in range(4):
            bed.popen(h, [sys.executable, "-c", PROBE, "serve", bed.addresses[h]])
        deadline = time.monotonic() + 30
        while not _reaches(bed, 0, 3) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _reaches(bed, 0, 1) and _reaches(bed, 2, 3)
        bed.cut(1)
        assert not _reaches(bed, 0, 1) and not _reaches(bed, 1, 2) and _reaches(bed, 0, 2)
        bed.heal()
        bed.cut_region([2, 3])
        assert _reaches(bed, 2, 3) and not _reaches(bed, 0, 2) and not _reaches(bed, 3, 1) and _reaches(bed, 0, 1)
        bed.heal()
        bed.cut_oneway(0, 1)  # 1's packets to 0 dropped: a TCP handshake fails both ways
        assert not _reaches(bed, 0, 1) and not _reaches(bed, 1, 0) and _reaches(bed, 1, 2)
        bed.heal()
        assert _reaches(bed, 0, 1, timeout=3) and _reaches(bed, 1, 0, timeout=3) and _reaches(bed, 0, 2, timeout=3)
        left = [p for h in range(4) for p in bed.pids(h)]
        assert left  # the probes' servers, until close
    assert bed.leftovers() == []
    assert all(p.poll() is not None for p in bed.procs)


CHILD = """
import sys, time
sys.path.insert(0, {here!r})
import hostbed
bed = hostbed.HostBed(3)
bed.popen(1, ["sleep", "600"])
while not bed.pids(1):  # `ip netns exec` has not entered the namespace yet
    time.sleep(0.01)
print(bed.tag, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_nothing_is_left_after_a_run_killed_halfway(sig):
    """A process with a bed and a process on one of its hosts is killed; its namespaces, the
    bridge and veths in them, and its processes are gone: at once by its own handler (SIGTERM,
    SIGINT), or swept by the next bed made here (SIGKILL: nothing of it can run)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE))], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    tag = child.stdout.readline().strip()
    assert tag.startswith(hostbed.PREFIX)
    names = [ns for ns in hostbed.bed_namespaces() if ns.startswith(tag + "-")]
    assert len(names) == 4  # the switch and three hosts
    sleeper = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"{tag}-h1"], capture_output=True,
                                              text=True).stdout.split()]
    assert sleeper
    child.send_signal(sig)
    child.wait(timeout=60)
    if sig == signal.SIGKILL:
        assert [ns for ns in hostbed.bed_namespaces() if ns.startswith(tag + "-")] == names  # left behind
        swept = hostbed.sweep_stale()
        assert set(names) <= set(swept)
    assert [ns for ns in hostbed.bed_namespaces() if ns.startswith(tag + "-")] == []
    for pid in sleeper:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split()[2] == "Z", f"pid {pid} of the bed still runs"
        except FileNotFoundError:
            pass
