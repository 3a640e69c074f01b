"""The coordinator: the fault-tolerant scheduler, and the single writer of `events.jsonl`.

    core.py         the process: sockets, workers, the event loop
    admission.py    who may join: the control port, the challenge, the hello
    messages.py     one handler per worker message type (runtime/protocol.py)
    workers.py      what it knows of each node's worker (WorkerState)
    generations.py  joining, announcing, aborting, committing steps, ending episodes
    planning.py     the next generation's slot map, a pure function of a View (keel.recovery's rules)
    faults.py       firing scheduled injections, lost workers, stragglers, quarantine, the restart baseline
    injections/     each fault class's injection, one module per class (keel/fault_classes.py names it)
    episodes.py     the episode book (stages as an Enum)
    stragglers.py   the straggler watch (measured timings in, verdicts out)
    snapshot.py     its durable state, for a successor
    succession.py   a successor of a coordinator that died, and the supervisor link
    stall.py        the stall report
    procs.py        the worker processes this machine starts
    __main__.py     `python -m runtime.coordinator`: the supervisor's child
"""
from runtime.coordinator.core import Coordinator, WorkerState, main

__all__ = ["Coordinator", "WorkerState", "main"]
