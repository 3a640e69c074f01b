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


FREEZING_MODES = ("hang", "partition")  # the worker is stopped (SIGSTOP), not killed
NODE_LOSS_MODES = ("kill",) + FREEZING_MODES


def kill_nodes(coord: Any, p: Any, planned: int, targets: list[str]) -> bool:
    """SIGKILL (SIGSTOP for a hang or a partition) the workers of `targets` in one loop, the
    same moment, as one episode; False where every target is down already (nothing to strike:
    the twin fires nothing either). A worker this coordinator did not spawn is told to do it
    itself (a cut-off one wakes `heal_s` later: runtime/worker_process.freeze_self)."""
    if not targets:
        return False
    ep = coord.new_episode(p.cls, p.target, nodes=targets, mode=p.mode, planned=planned)
    ep.nodes = targets
    sig = signal.SIGSTOP if p.mode in FREEZING_MODES else signal.SIGKILL
    for n in targets:  # one loop: the same moment
        coord.state.book.killed[n] = ep.fault_id
        w = coord.state.workers[n]
        # emulated: the machine crashed, so only the policy's heartbeat timeout can find it
        w.machine_down = coord.emulated and p.mode == "kill"
        if w.proc is not None:
            w.proc.signal(sig)
        elif w.chan is not None and p.mode == "kill":
            w.chan.send({"type": "kill"})
        elif w.chan is not None and p.mode == "partition":
            w.chan.send({"type": "partition", "heal_s": heal_s(coord, p)})
    return True


def heal_s(coord: Any, p: Any) -> float:
    """Wall seconds until a cut-off worker that froze itself wakes: its cut's heal, or where it
    does not heal, once the coordinator has surely counted it lost (it is then refused)."""
    d = float(p.params.get("duration_s") or 0.0)
    return (d if d > 0 else 2.0 * coord.policy.detect_timeout_s) * coord.scale
