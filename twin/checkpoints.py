"""Checkpoints: when one is due, the pause it costs the trainer and the rest of its write, which
goes on in the background and which its writer's loss (the lowest rank: every node holds the
whole state) or a restart aborts. The writer starts at its own result, before the last region
has its own, and stalls for the write (`sync`, then waits for the commit's confirmation) or the
snapshot (`async`, then writes in the background); the others run on into the next step, so the
pause is what the writer's late start adds to it (twin/cost.py `StepCost.checkpoint_s`). The
next checkpoint waits for the previous write, and the run ends once its last checkpoint (the
last step's, where one is due) is written. The bytes are spread over the nodes holding slots
(twin/cost.py `share_s`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator

import simpy

if TYPE_CHECKING:
    from twin.model import Simulation


class Checkpoints:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.env = sim.env
        self.cost = sim.cost
        self.params = sim.params
        self.config = sim.scenario.checkpoint
        self.run_steps = sim.scenario.run.steps
        self.step = 0          # the last complete checkpoint's step (0: none)
        self.attempted = 0     # the last step a checkpoint was taken at (its write may be running)
        self.writer: simpy.Process | None = None
        self.writing_node: str | None = None  # the node writing it (the lowest rank when it was taken)
        self.taken_at = -1.0   # when the last checkpoint was taken: at its step's commit

    def due(self, committed: int) -> bool:
        c = committed
        return (c > 0 and c % self.config.interval_steps == 0
                and c > self.attempted and c <= self.run_steps)

    def finish(self) -> Generator:
        """At the run's end, as the runtime ends a run: the last step's checkpoint where one is
        due, then the write still running (that one's or an earlier one's) until it is
        durable. False where nothing is left to do."""
        if self.due(self.sim.committed):
            yield from self.take()
            return True
        if self.writer is not None and self.writer.is_alive:
            yield from self.sim.wait(self.writer, "checkpoint")
            return True
        return False

    def abort(self, reason: str) -> None:
        """Interrupt the background write, if one is running: that checkpoint is lost."""
        if self.writer is not None and self.writer.is_alive:
            self.writer.interrupt(reason)

    def unconfirmed(self) -> None:
        """The coordinator died now under checkpoint_restart: a checkpoint taken at this very
        commit is never published, its step never confirmed (runtime/protocol.py); one of an
        earlier, confirmed step still is once written. Its pause is broken by the job's stop
        (`Cause.aborts_checkpoint`); the rest of its write, where the writer's region was ahead
        and the pause ended at once (sweep member 3/15), here."""
        if self.taken_at == self.env.now:
            self.abort("its step never confirmed")

    def nodes_lost(self, nodes: tuple[str, ...]) -> None:
        """Nodes died: the background write is lost if its writer is one of them (every node
        holds the whole state; another node's loss does not stop it, nor the runtime's)."""
        if self.writing_node in nodes:
            self.abort("its writer lost")

    def take(self) -> Generator:
        """Checkpoint the committed steps (inside the trainer process)."""
        sim = self.sim
        if self.writer is not None and self.writer.is_alive:
            done = yield from sim.wait(self.writer, "checkpoint")  # the previous write first
            if not done:
                return
        step = sim.committed
        mode = self.config.mode
        sim.emit("checkpoint_start", mode=mode)
        self.taken_at = self.env.now
        self.attempted = step  # once: a write broken off is not taken again (nor by the runtime)
        sync = mode == "sync"
        stall = self.cost.share_s(self.params.ckpt_write_gbyte_s if sync else self.params.ckpt_snapshot_gbyte_s)
        write = 0.0 if sync else self.cost.share_s(self.params.ckpt_write_gbyte_s)
        writer = sim.cluster.writer()
        pause, free, durable = self.cost.checkpoint_s(writer.region if writer is not None else None,
                                                      stall, write, sync)
        # what a fault in the pause finds in flight (StepCost.drain_s): the others started the
        # next step's compute at their step reports, the writer starts it once it is free
        compute = self.cost.compute_by_node()
        if writer is not None and writer.name in compute:
            compute[writer.name] += max(0.0, free)
        sim.inflight = (self.env.now, compute)
        if not (yield from sim.wait(pause, "checkpoint")):
            return
        if durable <= pause:
            self.step = step
            sim.emit("checkpoint_end", checkpoint_step=step)
        else:  # the rest of the write goes on while the others run on
            self.writing_node = writer.name if writer is not None else None
            self.writer = self.env.process(self._write(step, durable - pause))

    def _write(self, step: int, duration: float) -> Generator:
        """The rest of a checkpoint's write once the trainer runs on (async: the write after
        the snapshot; either mode: until the writer, behind the last region, is done)."""
        try:
            yield self.env.timeout(duration)
        except simpy.Interrupt:
            return
        self.step = step
        self.sim.emit("checkpoint_end", checkpoint_step=step)
