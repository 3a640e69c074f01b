"""The coordinator: the fault-tolerant scheduler, and the single writer of `events.jsonl`.

    core.py         the process: sockets, workers, the event loop and its message handlers
    generations.py  joining, announcing, aborting, committing steps, ending episodes
    planning.py     the next generation's slot map, a pure function of a View (keel.recovery's rules)
    faults.py       scheduled injections, lost workers, stragglers, quarantine, the restart baseline
    episodes.py     the episode book (stages as an Enum)
    stragglers.py   the straggler watch (measured timings in, verdicts out)
    stall.py        the stall report
    procs.py        the worker processes this machine starts
"""
from runtime.coordinator.core import Coordinator, WorkerState, main

__all__ = ["Coordinator", "WorkerState", "main"]
