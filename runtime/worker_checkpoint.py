"""The worker's checkpoints: the lowest rank writes one every `checkpoint.interval_steps`, in
the background in async mode; in an emulated cluster the snapshot and the write take the
scenario's storage time for this node's share. `Checkpoints` owns what is in flight (the
background writer, each step's stall and, emulated, when its write ends); the worker says
what to write."""
from __future__ import annotations

import os
import time
from typing import Any, Callable


class Checkpoints:
    def __init__(self, scenario, run_info: dict[str, Any], chan, job, emu, *, aborted: Callable[[], bool],
                 stopping: Callable[[], bool]):
        self.scenario = scenario
        self.run_info = run_info  # the coordinator's welcome: config hash, config, out_dir
        self.chan = chan          # the worker's CoordinatorLink (runtime/worker_link.py)
        self.aborted = aborted    # the worker's generation has ended: a synchronous write gives up
        self.stopping = stopping  # the worker is stopping: a write in the background gives up
        self.job = job
        self.emu = emu            # the emulated node (runtime/emulation/node.py), or None
        self.writer = None        # async mode: the background writer, once one is written
        self.stalls: dict[int, float] = {}
        self.write_end: dict = {}          # emulated: step -> when its write ends ("last": the newest)
        self.write_s: dict[int, float] = {}

    def _args(self, g: int, step: int, members: list[str], slot_map: dict, quarantine) -> dict[str, Any]:
        from runtime import checkpoint as ck
        sc = self.scenario
        topology = {"generation": g, "members": members, "slot_map": slot_map,
                    "slots": sc.slot_count,
                    "regions": [{"name": r.name, "nodes": r.nodes} for r in sc.regions]}
        return dict(step=step, model=self.job.model, optimizer=self.job.optimizer,
                    rng=ck.capture_rng(), data_state=self.job.loader.state(step, quarantine),
                    config_hash=self.run_info["config_hash"], config=self.run_info["scenario"],
                    topology=topology, extra=self.job.extra)

    def write(self, g: int, step: int, members: list[str], slot_map: dict, quarantine) -> None:
        """The checkpoint of `step` (committed) in generation `g`: async mode snapshots at the
        step boundary (the measured stall) and writes in the background."""
        from runtime import checkpoint as ck
        sc = self.scenario
        run_dir = os.path.join(self.run_info["out_dir"], "checkpoints")
        self.chan.send({"type": "ckpt_start", "step": step, "mode": sc.checkpoint.mode})
        t0 = time.perf_counter()
        emu = self.emu
        c0 = emu.c if emu is not None else 0.0
        if sc.checkpoint.mode == "async":
            if self.writer is None:
                self.writer = ck.AsyncCheckpointer(run_dir, keep=sc.checkpoint.keep, on_done=self._done,
                                                   before_commit=self._before_publish)
            stall = self.writer.snapshot_and_submit(**self._args(g, step, members, slot_map, quarantine))
            if emu is not None:  # after the previous write, the snapshot of this node's share
                emu.c = max(emu.c, self.write_end.get("last", 0.0))
                emu.c += emu.storage_s(len(members), sc.checkpoint.snapshot_gbyte_s)
                write_s = emu.storage_s(len(members), sc.checkpoint.write_gbyte_s)
                self.write_end[step] = self.write_end["last"] = emu.c + write_s
                self.write_s[step] = write_s
                emu.wait_until(emu.c)
                stall = emu.c - c0
            self.stalls[step] = float(stall)
        else:
            # emulated: this node's share written at the storage's speed before the rename that
            # publishes it, as in the background (`_before_publish`): a restart decided during
            # the write finds it unpublished, as on the cluster (sweep member 3/25, 7 Dec)
            written = c0 + emu.storage_s(len(members), sc.checkpoint.write_gbyte_s) if emu is not None else None

            def before_publish() -> None:
                if written is not None:
                    emu.wait_until(written)
                self.chan.await_confirmed(step, self.aborted)
            try:
                path = ck.save_checkpoint(run_dir, keep=sc.checkpoint.keep,
                                          **self._args(g, step, members, slot_map, quarantine),
                                          before_commit=before_publish)
                err = None
            except Exception as e:
                path, err = None, e
            stall = time.perf_counter() - t0
            if emu is not None:  # the write of this node's share, and the coordinator's confirm it waited for
                confirmed = emu.at(self.chan.confirmed_at) if err is None else 0.0
                emu.c = max(written, confirmed)
                emu.wait_until(emu.c)
                stall = emu.c - c0
            self.stalls[step] = stall
            self._done(step, path, stall, err)

    def _before_publish(self, step: int) -> None:
        """In the writer thread, before the rename that publishes the checkpoint: an emulated
        write lasts what the scenario's storage takes for this node's share; then the step must
        be one the coordinator confirmed (runtime/protocol.py), or the checkpoint is dropped
        when this worker leaves first. (A synchronous write waits the same way in `write`,
        and gives up when its generation ends.)"""
        if self.emu is not None:
            self.emu.wait_until(self.write_end[step])
        self.chan.await_confirmed(step, self.stopping)

    def _done(self, step: int, path, write_s: float, error) -> None:
        self.write_end.pop(step, None)
        write_s = self.write_s.pop(step, write_s)  # emulated: the storage's, not the real small write
        msg = {"type": "ckpt_end", "step": step, "stall_s": self.stalls.pop(step, None), "write_s": write_s,
               "path": str(path) if path else None}
        if error is not None:
            msg["error"] = str(error)[:300]
        self.chan.send(msg)

    def finish(self) -> None:
        """Wait for the write in the background, if any."""
        if self.writer is not None:
            self.writer.wait()
