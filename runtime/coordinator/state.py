"""The coordinator's state, in plain view: every field its decisions read and write, in one
dataclass. The modules beside it (generations.py, faults.py, messages.py, admission.py,
succession.py) are functions of the Coordinator that read and write these fields; snapshot.py
saves the durable ones for a successor and builds a fresh state from them.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.coordinator.episodes import EpisodeBook
from runtime.coordinator.stragglers import StragglerWatch
from runtime.coordinator.workers import WorkerState

JOIN_TIMEOUT_S = 600.0  # workers not joined by then fail the run


class Phase(enum.StrEnum):
    """Where the run stands. joining -> running (a generation announced) -> aborting (a loss, a
    straggler to move: the generation ends) -> running ... -> finishing (the last step
    committed: members report done) -> finished. checkpoint_restart adds restarting (every
    worker relaunched) -> joining."""
    JOINING = "joining"
    RUNNING = "running"
    ABORTING = "aborting"
    FINISHING = "finishing"
    FINISHED = "finished"
    RESTARTING = "restarting"


@dataclass(kw_only=True, slots=True)
class CoordinatorState:
    # ---- durable: a successor restores these from coordinator.json (snapshot.py)
    t0: float                                  # time.monotonic() at run_start (machine-wide)
    watch: StragglerWatch                      # measured timings, slow and good probes in a row
    phase: Phase = Phase.JOINING               # assigned by `enter` only
    gen: int = -1                              # the generation announced last
    members: list[str] = field(default_factory=list)       # its members, in scenario order (= ranks)
    slot_map: dict[str, list[int]] = field(default_factory=dict)  # member -> its slots
    gen_start_step: int = 0                    # the step it started after
    start_step: int = 0                        # the step this run started after (a resume, a restart)
    committed: int = 0                         # steps committed (rebuilt from the event log)
    quarantine: set[int] = field(default_factory=set)  # data shards quarantined
    to_park: dict[str, int | None] = field(default_factory=dict)    # stragglers to park: node -> fault_id
    to_unpark: dict[str, int | None] = field(default_factory=dict)  # parked ones to take back
    fired: int = 0                             # scheduled faults fired (an index into coord.planned)
    restarts: int = 0                          # checkpoint_restart's relaunches
    not_before: float = 0.0                    # emulated: the next generation starts no earlier (restart_s)
    load_path: str | None = None               # a checkpoint the next generation loads
    final_sha: str | None = None               # the members' final weights, once they agree
    last_commit_t: float | None = None         # run seconds of the last commit (clean intervals)
    deaths_logged: int = -1                    # the supervisor's number of the last coordinator death logged
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (members, s) per clean commit interval
    gen_t: dict[int, dict[str, float]] = field(default_factory=dict)  # per generation: abort_s, pg_s, state_s, ready, announced
    checkpoints: list[dict[str, Any]] = field(default_factory=list)   # as the writers reported them
    pid_history: dict[str, list[int]] = field(default_factory=dict)   # node -> every pid it had
    emu_stats: dict[str, Any] = field(default_factory=dict)           # emulated: late reports, relaunches
    workers: dict[str, WorkerState] = field(default_factory=dict)     # node -> what is known of its worker
    book: EpisodeBook = field(default_factory=EpisodeBook)            # one episode per fault
    # ---- this process's: rebuilt from the event log, or of the current generation only
    losses: dict[int, float] = field(default_factory=dict)            # step -> committed loss
    reports: dict[int, dict[str, dict]] = field(default_factory=dict)  # step -> member -> its report
    nonfinite: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # step -> member -> suspect shards
    pending_acks: set[str] = field(default_factory=set)  # members of an aborted generation yet to leave it
    abort_deadline: float = 0.0                # monotonic: they are lost after it
    t_abort: float = 0.0                       # run seconds of the abort (the next generation's abort_s)
    join_deadline: float = 0.0                 # monotonic: workers not joined by then fail the run
    last_progress: float = field(default_factory=time.monotonic)  # monotonic: the last commit or announcement
    last_event_was_commit: bool = False        # a commit right after a commit is a clean interval
    succeeding: bool = False                   # a successor, before its first announcement
    job_params: int | None = None              # the job's trainable parameters, as the workers' `done` says
    failure: str | None = None                 # why the run failed: the loop raises RunFailed with it

    def enter(self, phase: Phase) -> None:
        """The one place the phase changes."""
        self.phase = phase


EMU_STATS = {"reports": 0, "overruns": 0, "compute_overruns": 0, "late_s": 0.0, "worst_late_s": 0.0,
             "warmup_reports": 0, "warmup_late_s": 0.0, "relaunches": 0, "relaunch_overruns": 0,
             "relaunch_late_s": 0.0, "heartbeat_late_s": 0.0, "successor_late_s": 0.0}
