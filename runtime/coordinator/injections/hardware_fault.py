"""`hardware_fault`: SIGKILL of the target worker process (the coordinator signals the pid
it spawned; a worker it did not spawn is told to SIGKILL itself); a test hang SIGSTOPs it."""
from __future__ import annotations

from typing import Any

from runtime.coordinator.injections import kill_nodes


def fire(coord: Any, p: Any, planned: int) -> bool:
    return kill_nodes(coord, p, planned, [p.target] if coord.live(p.target) else [])
