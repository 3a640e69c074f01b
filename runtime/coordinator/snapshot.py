"""The coordinator's durable state: what a successor needs to carry the run on after the
coordinator process dies (runtime/supervisor.py starts it).

Two files in the run directory hold it. `events.jsonl` (flushed as written) is the truth for
what happened: steps committed and their losses, faults and their episodes' stages, the
quarantine, checkpoints. `coordinator.json` (written whole, fsynced, then renamed over the
old one, at the end of every loop turn that changed something, but at most once a second for
turns that only committed steps) holds the rest: the
generation, its members and slot map, what is known of each worker, the fault schedule's
progress, the straggler watch, timings. It names how many of the run's events it covers; a
successor replays the events beyond that (`_replay`), so a death between an event and the
next snapshot loses nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from keel.durable import fsync_dir, write_synced
from keel.events import Event, EventLogError, validate_event

from runtime.coordinator import injections
from runtime.coordinator.episodes import Episode, EpisodeBook, Stage
from runtime.coordinator.state import CoordinatorState, Phase
from runtime.coordinator.stragglers import StragglerWatch
from runtime.coordinator.workers import WorkerState

STATE_FILE = "coordinator.json"
VERSION = 1
SNAPSHOT_EVERY_S = 1.0   # a loop turn that only committed steps saves at most this often
KEEP_INTERVALS = 10_000  # clean commit intervals kept for the step-time median
REJOIN_GRACE_S = 2.0     # wall seconds a successor adds to its detection timeouts for rejoins

_WORKER_FIELDS = ("pid", "alive", "joined", "committed", "role", "parked", "machine_down", "done_sha", "ready_gen")
_PLAIN = ("t0", "gen", "phase", "gen_start_step", "start_step", "fired", "restarts", "not_before",
            "load_path", "final_sha", "last_commit_t", "deaths_logged", "members", "slot_map", "to_park",
            "to_unpark", "checkpoints", "pid_history", "emu_stats")  # CoordinatorState fields JSON holds as they are


def snapshot(c: Any) -> dict[str, Any]:
    """Everything the event log does not say: the durable fields of the coordinator's state
    (state.CoordinatorState), as plain JSON."""
    st = c.state
    return {
        "version": VERSION, "n_events": len(c.log.events) - c.events_start, "pid": os.getpid(),
        **{k: getattr(st, k) for k in _PLAIN},
        "quarantine": sorted(st.quarantine), "intervals": st.intervals[-KEEP_INTERVALS:],
        "gen_t": {str(g): t for g, t in st.gen_t.items() if g >= st.gen - 1},
        "watch": st.watch.state(),
        "episodes": [{**dataclasses.asdict(ep), "stage": int(ep.stage)} for ep in st.book],
        "killed": st.book.killed,
        "workers": {n: {k: getattr(x, k) for k in _WORKER_FIELDS} for n, x in st.workers.items()},
    }


def save(c: Any) -> None:
    path = c.out / STATE_FILE
    tmp = path.with_name(STATE_FILE + ".tmp")
    write_synced(tmp, json.dumps(snapshot(c), separators=(",", ":")).encode())
    os.replace(tmp, path)
    fsync_dir(c.out)


def load(out: Path) -> dict[str, Any]:
    """The newest snapshot of the run in `out`."""
    try:
        state = json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{out / STATE_FILE}: the coordinator's state cannot be read ({e})") from None
    if state.get("version") != VERSION:
        raise RuntimeError(f"{out / STATE_FILE}: version {state.get('version')!r}, expected {VERSION}")
    return state


def run_events(path: Path) -> list[Event]:
    """This run's events in `path`: from its last `run_start` on. A last line the dead
    coordinator left half-written is cut off (and said on stderr); anything else that does not
    parse is an error."""
    data = path.read_bytes()
    events, pos = [], 0
    for n, line in enumerate(data.splitlines(keepends=True), 1):
        start, pos = pos, pos + len(line)
        if not line.strip():
            continue
        try:
            events.append(validate_event(json.loads(line), f"{path}:{n}"))
        except (ValueError, EventLogError) as e:
            if pos < len(data) or line.endswith(b"\n"):
                raise e if isinstance(e, EventLogError) else EventLogError(f"{path}:{n}: not valid JSON ({e})") from None
            os.truncate(path, start)
            print(f"keel: {path}:{n}: a half-written last event cut off", file=sys.stderr, flush=True)
    starts = [i for i, e in enumerate(events) if e.kind == "run_start"]
    return events[starts[-1]:] if starts else []


def restore(c: Any, state: dict[str, Any]) -> CoordinatorState:
    """The dead coordinator's state, for the coordinator `c` (fresh, same scenario): the
    snapshot, then the events beyond it (which `c`'s log then holds)."""
    book = EpisodeBook()
    for d in state["episodes"]:
        ep = Episode(**{**d, "stage": Stage(d["stage"])})
        book.episodes[ep.fault_id] = ep
    book.killed = dict(state["killed"])
    now = time.monotonic()
    st = CoordinatorState(
        **{k: state[k] for k in _PLAIN if k != "phase"}, phase=Phase(state["phase"]),
        quarantine=set(state["quarantine"]), intervals=[tuple(x) for x in state["intervals"]],
        gen_t={int(g): t for g, t in state["gen_t"].items()}, book=book,
        watch=StragglerWatch.restored(c.policy.straggler_factor, c.policy.straggler_window, c.sc.node_speeds,
                                     state["watch"]),
        workers={n: WorkerState(node=n, last_seen=now + REJOIN_GRACE_S, **{k: x[k] for k in _WORKER_FIELDS})
                 for n, x in state["workers"].items()})
    events = run_events(c.log.path)
    c.log.events = events
    c.events_start = 0
    st.committed = st.start_step
    for e in events:
        if e.kind == "step":
            st.committed = e.step
            st.losses[e.step] = e.detail["loss"]
        elif e.kind == "restart":  # checkpoint_restart rolled the run back to its checkpoint
            st.committed = int(e.detail["from_step"])
    _replay(st, events[state["n_events"]:])
    return st


def _replay(st: CoordinatorState, tail: list[Event]) -> None:
    """Apply the events the dead coordinator wrote after its last snapshot."""
    for e in tail:
        ep = st.book.get(e.detail.get("fault_id"))
        if e.kind == "fault" and ep is None:
            ep = Episode(e.detail["fault_id"], e.fault, e.target, e.action, e.t, nodes=list(e.detail.get("nodes", ())))
            st.book.episodes[ep.fault_id] = ep
            for n in ep.nodes:
                if e.detail.get("mode") in injections.NODE_LOSS_MODES:
                    st.book.killed[n] = ep.fault_id
            if "planned" in e.detail:
                st.fired = max(st.fired, int(e.detail["planned"]) + 1)
        elif ep is not None and e.kind == "detect":
            ep.detect(e.t)
            if "death" in e.detail:
                st.deaths_logged = max(st.deaths_logged, int(e.detail["death"]))
        elif ep is not None and e.kind == "recover_start":
            ep.start_recovery()
        elif ep is not None and e.kind == "recover_end":
            ep.stage = Stage.ENDED
        elif e.kind == "quarantine":
            st.quarantine = set(e.detail.get("quarantine", st.quarantine))
        elif e.kind == "checkpoint_end" and not any(x["step"] == e.detail.get("ckpt_step") for x in st.checkpoints):
            st.checkpoints.append({"step": e.detail.get("ckpt_step"), "path": e.detail.get("path"),
                                  "stall_s": e.detail.get("stall_s"), "write_s": e.detail.get("write_s"),
                                  "node": e.detail.get("node")})
        elif e.kind == "reslot":
            st.slot_map = {m: list(s) for m, s in e.detail["slot_map"].items()}
