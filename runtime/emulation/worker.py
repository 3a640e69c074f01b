"""The worker's part of the emulated cluster (a mixin of runtime.worker.Worker): the warm-up
before joining, the reduction's layout and pairs, and the hierarchical all-reduce priced by the
link emulator (runtime/emulation/hier.py, netem.py, node.py say how)."""
from __future__ import annotations

import torch


class EmulatedNodeMixin:
    def _warm_up(self) -> None:
        """Emulated: one forward and backward pass before joining, so the first step's compute
        is not the small model's lazy set-up (a cost of the test bed, not of the cluster). The
        RNG and the gradients are left as they were."""
        from runtime.model import slot_loss
        with torch.random.fork_rng(devices=[]):
            b = self.loader.batch(0, 0)
            slot_loss(self.model, b.x.to(self.device), b.y.to(self.device), b.w.to(self.device)).backward()
        self.model.zero_grad(set_to_none=True)

    def _ring_ranks(self) -> tuple[tuple[int, ...], ...]:
        """This generation's ranks grouped by region, in ring order (keel.hardware.ring_members)."""
        if self._ring is None:
            from keel import hardware
            index = {n: i for i, n in enumerate(self.members)}
            self._ring = tuple(tuple(index[n] for n in grp) for grp in hardware.ring_members(self.scenario, self.members))
        return self._ring

    def _connect(self, pg, rank: int, should_abort) -> None:
        """Emulated: gloo connects a pair lazily, on its first message; the reduction's pairs are
        connected here, with the group (real formation work), instead of inside the first step."""
        from runtime.emulation import hier
        for k, (length, dtype) in enumerate([(self.layout.total + 2, torch.int64), (self.layout.segments + 1, torch.float32)]):
            hier.run_plan(pg, rank, hier.plan_for(self._ring_ranks(), length), torch.zeros(length, dtype=dtype),
                          "sum", 0.0, lambda step, msg, t: 0.0, should_abort, self.waiter, tag_base=(8 + k) * 4096)

    def _emulated_collective(self, pg, t: torch.Tensor, op: str, should_abort) -> torch.Tensor:
        """One all-reduce of the emulated cluster: the hierarchical plan over this generation's
        regions (keel.hardware.ring_members), every message priced by the link emulator. A
        gradient element stands for workload.gradient_bytes / its vector's length; the short
        maxima of a two-round step for their own 4 bytes."""
        from runtime.emulation import hier
        emu = self.emu
        pricer = emu.pricer
        pricer.bytes_per_element = (self.scenario.workload.gradient_bytes / self.layout.total if op == "sum"
                                    else float(t.element_size()))
        pricer.key = f"g{self.gen}/s{self.committed}/r{self._round}"
        emu.c = hier.run_plan(pg, self.rank, hier.plan_for(self._ring_ranks(), t.numel()), t, op, emu.c, pricer,
                              should_abort, self.waiter, tag_base=(self._round % 8) * 4096)
        self._round += 1
        return t
