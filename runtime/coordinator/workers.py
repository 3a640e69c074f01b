"""What the coordinator knows of each scenario node's worker process."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.coordinator.procs import SupervisedProcess
from runtime.protocol import Channel


@dataclass
class WorkerState:
    node: str
    chan: Channel | None = None
    proc: SupervisedProcess | None = None  # None: a worker started elsewhere
    pid: int | None = None
    alive: bool = True
    joined: bool = False
    last_seen: float = 0.0
    committed: int = 0
    role: str = "standby"  # member | standby | dead
    parked: list[int] | None = None  # slots of a straggler standing by
    done_sha: str | None = None
    last_msg: dict | None = None  # the last message other than a heartbeat (for stall reports)
    last_msg_t: float = 0.0
    last_hb_t: float = 0.0
    at: str | None = None  # where the worker says it is (sent with each heartbeat)
    ready_gen: int = -1
    machine_down: bool = False  # emulated: its machine crashed; only the heartbeat timeout finds it
