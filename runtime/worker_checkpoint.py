"""The worker's checkpoints (a mixin of runtime.worker.Worker): the lowest rank writes one every
`checkpoint.interval_steps`, in the background in async mode; in an emulated cluster the
snapshot and the write take the scenario's storage time for this node's share."""
from __future__ import annotations

import os
import time
from typing import Any


class CheckpointMixin:
    def _checkpoint_args(self, g: int) -> dict[str, Any]:
        from runtime import checkpoint as ck
        sc = self.scenario
        topology = {"generation": g, "members": self.members, "slot_map": self.slot_map,
                    "slots": sc.slot_count,
                    "regions": [{"name": r.name, "nodes": r.nodes} for r in sc.regions]}
        return dict(step=self.committed, model=self.model, optimizer=self.optimizer,
                    rng=ck.capture_rng(), data_state=self.loader.state(self.committed, self.quarantine),
                    config_hash=self.run_info["config_hash"], config=self.run_info["scenario"],
                    topology=topology, extra=self.job.extra)

    def _checkpoint(self, g: int) -> None:
        """The lowest rank writes every `checkpoint.interval_steps`: async mode snapshots at the
        step boundary (the measured stall) and writes in the background."""
        from runtime import checkpoint as ck
        sc = self.scenario
        step = self.committed
        run_dir = os.path.join(self.run_info["out_dir"], "checkpoints")
        self.chan.send({"type": "ckpt_start", "step": step, "mode": sc.checkpoint.mode})
        t0 = time.perf_counter()
        emu = self.emu
        c0 = emu.c if emu is not None else 0.0
        if sc.checkpoint.mode == "async":
            if self.checkpointer is None:
                self.checkpointer = ck.AsyncCheckpointer(run_dir, keep=sc.checkpoint.keep, on_done=self._ckpt_done,
                                                         before_commit=self._before_publish)
            stall = self.checkpointer.snapshot_and_submit(**self._checkpoint_args(g))
            if emu is not None:  # after the previous write, the snapshot of this node's share
                emu.c = max(emu.c, self._write_end.get("last", 0.0))
                emu.c += emu.storage_s(len(self.members), sc.checkpoint.snapshot_gbyte_s)
                write_s = emu.storage_s(len(self.members), sc.checkpoint.write_gbyte_s)
                self._write_end[step] = self._write_end["last"] = emu.c + write_s
                self._write_s[step] = write_s
                emu.wait_until(emu.c)
                stall = emu.c - c0
            self._stalls[step] = float(stall)
        else:
            try:
                path = ck.save_checkpoint(run_dir, keep=sc.checkpoint.keep, **self._checkpoint_args(g),
                                          before_commit=lambda: self.chan.await_confirmed(step, self.abort_event.is_set))
                err = None
            except Exception as e:
                path, err = None, e
            stall = time.perf_counter() - t0
            if emu is not None:
                emu.c += emu.storage_s(len(self.members), sc.checkpoint.write_gbyte_s)
                emu.wait_until(emu.c)
                stall = emu.c - c0
            self._stalls[step] = stall
            self._ckpt_done(step, path, stall, err)

    def _before_publish(self, step: int) -> None:
        """In the writer thread, before the rename that publishes the checkpoint: an emulated
        write lasts what the scenario's storage takes for this node's share; then the step must
        be one the coordinator confirmed (runtime/protocol.py), or the checkpoint is dropped
        when this worker leaves first. (A synchronous write waits the same way in `_checkpoint`,
        and gives up when its generation ends.)"""
        if self.emu is not None:
            self.emu.wait_until(self._write_end[step])
        self.chan.await_confirmed(step, lambda: self.stopping)

    def _ckpt_done(self, step: int, path, write_s: float, error) -> None:
        self._write_end.pop(step, None)
        write_s = self._write_s.pop(step, write_s)  # emulated: the storage's, not the real small write
        msg = {"type": "ckpt_end", "step": step, "stall_s": self._stalls.pop(step, None), "write_s": write_s,
               "path": str(path) if path else None}
        if error is not None:
            msg["error"] = str(error)[:300]
        self.chan.send(msg)

    def _finish_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
