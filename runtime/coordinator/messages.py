"""The coordinator's handlers of the worker messages the protocol declares (runtime/protocol.py),
one per type, dispatched by `Coordinator.on_message` through `HANDLERS`: functions of the
Coordinator (core.py) on its state (state.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.coordinator import faults, generations
from runtime.coordinator.state import Phase

if TYPE_CHECKING:
    from runtime.coordinator.core import Coordinator
    from runtime.coordinator.workers import WorkerState


def on_hb(c: Coordinator, w: WorkerState, msg: dict) -> None:
    if w.parked is not None and "probe_s" in msg:
        faults.probe(c, w, float(msg["probe_s"]))


def on_joined(c: Coordinator, w: WorkerState, msg: dict) -> None:
    w.joined = True
    w.committed = int(msg.get("committed", 0))


def on_step(c: Coordinator, w: WorkerState, msg: dict) -> None:
    st = c.state
    if "late_s" in msg and not msg.get("resent"):
        es = st.emu_stats
        late = float(msg["late_s"])
        if msg.get("warmup"):  # a process's first step: the small model's and gloo's set-up
            es["warmup_reports"] += 1
            es["warmup_late_s"] = max(es["warmup_late_s"], late)
        else:
            es["reports"] += 1
            es["overruns"] += late > 0
            es["compute_overruns"] += bool(msg.get("compute_overrun"))
            es["late_s"] += late
            es["worst_late_s"] = max(es["worst_late_s"], late)
    if int(msg["gen"]) == st.gen and w.role == "member":
        w.committed = int(msg["step"])
        st.reports.setdefault(int(msg["step"]), {})[w.node] = msg
        if st.phase == Phase.RUNNING:
            generations.try_commit(c)
    elif st.succeeding and int(msg["step"]) > st.committed:  # reports the dead coordinator did not commit
        st.reports.setdefault(int(msg["step"]), {})[w.node] = msg


def on_ready(c: Coordinator, w: WorkerState, msg: dict) -> None:
    t = c.state.gen_t.setdefault(int(msg["gen"]), {})
    t["pg_s"] = max(t.get("pg_s", 0.0), float(msg["pg_s"]))
    t["state_s"] = max(t.get("state_s", 0.0), float(msg["state_s"]))
    t["ready"] = c.now()
    w.ready_gen = max(w.ready_gen, int(msg["gen"]))
    generations.adopt(c)


def on_nonfinite(c: Coordinator, w: WorkerState, msg: dict) -> None:
    st = c.state
    if int(msg["gen"]) == st.gen and st.phase == Phase.RUNNING:
        st.nonfinite.setdefault(int(msg["step"]), {})[w.node] = list(msg["suspects"])
        faults.try_nonfinite(c, int(msg["step"]))


def on_aborted(c: Coordinator, w: WorkerState, msg: dict) -> None:
    w.committed = int(msg["committed"])
    if int(msg["gen"]) <= c.state.gen:  # a successor's generation number is past the one left (succession.py)
        c.state.pending_acks.discard(w.node)


def on_ckpt_start(c: Coordinator, w: WorkerState, msg: dict) -> None:
    # the lowest rank reports its checkpoint right after its own step report, often before
    # the others' reports let the coordinator commit that step: the event carries the
    # checkpoint's step, never committed - 1
    k = int(msg["step"])
    c.emit("checkpoint_start", step=k, mode=msg.get("mode"), ckpt_step=k, node=w.node)


def on_ckpt_end(c: Coordinator, w: WorkerState, msg: dict) -> None:
    entry = {"step": int(msg["step"]), "path": msg.get("path"), "stall_s": msg.get("stall_s"),
             "write_s": msg.get("write_s"), "node": w.node}
    if msg.get("error"):
        entry["error"] = msg["error"]
    c.state.checkpoints.append(entry)
    c.emit("checkpoint_end", step=max(c.state.committed, entry["step"]), ckpt_step=entry["step"],
           stall_s=entry["stall_s"], write_s=entry["write_s"], path=entry["path"], node=w.node,
           **({"error": entry["error"]} if "error" in entry else {}))


def on_done(c: Coordinator, w: WorkerState, msg: dict) -> None:
    w.done_sha = msg["sha256"]
    if isinstance(msg.get("params"), int):
        c.state.job_params = msg["params"]
    w.committed = int(msg["committed"])
    if c.state.phase == Phase.FINISHING:
        generations.check_finished(c)


def on_error(c: Coordinator, w: WorkerState, msg: dict) -> None:
    c.state.failure = f"worker {w.node} failed:\n{msg.get('message', '')}"


HANDLERS = {"hb": on_hb, "joined": on_joined, "step": on_step, "ready": on_ready,
            "nonfinite": on_nonfinite, "aborted": on_aborted, "ckpt_start": on_ckpt_start,
            "ckpt_end": on_ckpt_end, "done": on_done, "error": on_error}
