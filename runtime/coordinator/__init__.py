"""The coordinator: the fault-tolerant scheduler, and the single writer of `events.jsonl`.

    core.py         the Coordinator: the process, its connections, the event loop, events
    state.py        its state, every field its decisions use (CoordinatorState, Phase)
    admission.py    who may join: the control port's connections, the challenge, the hello
    messages.py     one handler per worker message type (runtime/protocol.py)
    generations.py  joining, announcing, committing steps, ending episodes
    planning.py     the next generation's slot map, a pure function of a View (keel.recovery's rules)
    faults.py       firing scheduled injections, lost workers, stragglers, quarantine, the restart baseline
    injections/     each fault class's injection, one module per class (keel/fault_classes.py names it)
    episodes.py     the episode book (stages as an Enum)
    stragglers.py   the straggler watch (measured timings in, verdicts out)
    workers.py      what it knows of each node's worker (WorkerState)
    snapshot.py     its durable state (coordinator.json), for a successor
    succession.py   a successor of a coordinator that died
    link.py         the link to its supervisor (SupervisorLink: spawns, exits, hb)
    stall.py        the stall report
    procs.py        the worker processes this machine starts
    cli.py          `python -m runtime.coordinator`, by hand or as the supervisor's child
    __main__.py     runs cli.py

admission, messages, generations, faults and succession are functions of the Coordinator
(`c`), reading and writing `c.state`; they call each other one way (admission -> succession
-> faults, messages -> generations -> faults -> injections) and back into the Coordinator only
for what all of them use (events, episodes' ends, the abort, starting a worker).
"""
from runtime.coordinator.cli import main
from runtime.coordinator.core import Coordinator
from runtime.coordinator.state import CoordinatorState, Phase
from runtime.coordinator.workers import WorkerState

__all__ = ["Coordinator", "CoordinatorState", "Phase", "WorkerState", "main"]
