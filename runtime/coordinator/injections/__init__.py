"""Each fault class's injection in the runtime, one module per class (named by its registry
entry, keel/fault_classes.py). A module has

    fire(coord, p, planned) -> bool

which performs the scheduled injection `p` (a runtime.inject.Planned; `planned` is its place
in the coordinator's plan, replayed as fired by a successor) on the Coordinator `coord`,
opening its episode where it strikes, and says whether it killed or stopped a worker (the
coordinator then fires nothing more at this decision point). A test hang (`mode` "hang") is a
hardware_fault's injection with SIGSTOP for SIGKILL.
"""
from __future__ import annotations

import importlib
import signal
from types import ModuleType
from typing import Any

from keel import fault_classes as FC


def module(fault_class: str) -> ModuleType:
    """The runtime module of `fault_class`; an unknown class raises ValueError."""
    return importlib.import_module(FC.get(fault_class).runtime)


def kill_nodes(coord: Any, p: Any, planned: int, targets: list[str]) -> bool:
    """SIGKILL (SIGSTOP for a hang) the workers of `targets` in one loop, the same moment, as
    one episode; False where every target is down already (nothing to strike: the twin fires
    nothing either)."""
    if not targets:
        return False
    ep = coord._new_episode(p.cls, p.target, nodes=targets, mode=p.mode, planned=planned)
    ep.nodes = targets
    sig = signal.SIGSTOP if p.mode == "hang" else signal.SIGKILL
    for n in targets:  # one loop: the same moment
        coord.book.killed[n] = ep.fault_id
        w = coord.workers[n]
        # emulated: the machine crashed, so only the policy's heartbeat timeout can find it
        w.machine_down = coord.emulated and p.mode == "kill"
        if w.proc is not None:
            w.proc.signal(sig)
        elif p.mode == "kill" and w.chan is not None:
            w.chan.send({"type": "kill"})
    return True
