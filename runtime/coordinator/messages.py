"""The coordinator's handlers of the worker messages the protocol declares (runtime/protocol.py),
one per type, dispatched by `Coordinator._on_message` through `HANDLERS` (a mixin of
runtime.coordinator.core.Coordinator)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.coordinator.workers import WorkerState


class MessagesMixin:
    def _on_hb(self, w: "WorkerState", msg: dict) -> None:
        if w.parked is not None and "probe_s" in msg:
            self._probe(w, float(msg["probe_s"]))

    def _on_joined(self, w: "WorkerState", msg: dict) -> None:
        w.joined = True
        w.committed = int(msg.get("committed", 0))

    def _on_step(self, w: "WorkerState", msg: dict) -> None:
        if "late_s" in msg and not msg.get("resent"):
            st = self.emu_stats
            late = float(msg["late_s"])
            if msg.get("warmup"):  # a process's first step: the small model's and gloo's set-up
                st["warmup_reports"] += 1
                st["warmup_late_s"] = max(st["warmup_late_s"], late)
            else:
                st["reports"] += 1
                st["overruns"] += late > 0
                st["compute_overruns"] += bool(msg.get("compute_overrun"))
                st["late_s"] += late
                st["worst_late_s"] = max(st["worst_late_s"], late)
        if int(msg["gen"]) == self.gen and w.role == "member":
            w.committed = int(msg["step"])
            self.reports.setdefault(int(msg["step"]), {})[w.node] = msg
            if self.phase == "running":
                self._try_commit()
        elif self.succeeding and int(msg["step"]) > self.committed:  # reports the dead coordinator did not commit
            self.reports.setdefault(int(msg["step"]), {})[w.node] = msg

    def _on_ready(self, w: "WorkerState", msg: dict) -> None:
        t = self.gen_t.setdefault(int(msg["gen"]), {})
        t["pg_s"] = max(t.get("pg_s", 0.0), float(msg["pg_s"]))
        t["state_s"] = max(t.get("state_s", 0.0), float(msg["state_s"]))
        t["ready"] = self.now()
        w.ready_gen = max(w.ready_gen, int(msg["gen"]))

    def _on_nonfinite(self, w: "WorkerState", msg: dict) -> None:
        if int(msg["gen"]) == self.gen and self.phase == "running":
            self.nonfinite.setdefault(int(msg["step"]), {})[w.node] = list(msg["suspects"])
            self._try_nonfinite(int(msg["step"]))

    def _on_aborted(self, w: "WorkerState", msg: dict) -> None:
        w.committed = int(msg["committed"])
        if int(msg["gen"]) <= self.gen:  # a successor's generation number is past the one left (succession.py)
            self.pending_acks.discard(w.node)

    def _on_ckpt_start(self, w: "WorkerState", msg: dict) -> None:
        # the lowest rank reports its checkpoint right after its own step report, often before
        # the others' reports let the coordinator commit that step: the event carries the
        # checkpoint's step, never committed - 1
        k = int(msg["step"])
        self.emit("checkpoint_start", step=k, mode=msg.get("mode"), ckpt_step=k, node=w.node)

    def _on_ckpt_end(self, w: "WorkerState", msg: dict) -> None:
        entry = {"step": int(msg["step"]), "path": msg.get("path"), "stall_s": msg.get("stall_s"),
                 "write_s": msg.get("write_s"), "node": w.node}
        if msg.get("error"):
            entry["error"] = msg["error"]
        self.checkpoints.append(entry)
        self.emit("checkpoint_end", step=max(self.committed, entry["step"]), ckpt_step=entry["step"],
                  stall_s=entry["stall_s"], write_s=entry["write_s"], path=entry["path"], node=w.node,
                  **({"error": entry["error"]} if "error" in entry else {}))

    def _on_done(self, w: "WorkerState", msg: dict) -> None:
        w.done_sha = msg["sha256"]
        if isinstance(msg.get("params"), int):
            self.job_params = msg["params"]
        w.committed = int(msg["committed"])
        if self.phase == "finishing":
            self._check_finished()

    def _on_error(self, w: "WorkerState", msg: dict) -> None:
        self.failure = f"worker {w.node} failed:\n{msg.get('message', '')}"

    HANDLERS = {"hb": _on_hb, "joined": _on_joined, "step": _on_step, "ready": _on_ready,
                "nonfinite": _on_nonfinite, "aborted": _on_aborted, "ckpt_start": _on_ckpt_start,
                "ckpt_end": _on_ckpt_end, "done": _on_done, "error": _on_error}
