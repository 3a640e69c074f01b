"""The worker's part of the emulated cluster: the warm-up before joining, and the hierarchical
all-reduce priced by the link emulator (runtime/emulation/hier.py, netem.py, node.py say how),
over the reduction's pairs connected with the group. `EmulatedComms` owns what it needs of
the generation (its rank, its ring by region) and of the step (its rounds so far)."""
from __future__ import annotations

import torch

from runtime.waiting import Waiter, run_watched


def warm_up(job) -> None:
    """Emulated: one forward and backward pass before joining, so the first step's compute
    is not the job's lazy set-up (a cost of the test bed, not of the cluster). The
    RNG and the gradients are left as they were."""
    with torch.random.fork_rng(devices=[]):
        job.slot_vector(0, 0)  # the job's own slot (runtime/job_run.py)
    job.model.zero_grad(set_to_none=True)


class EmulatedComms:
    def __init__(self, scenario, emu, waiter):
        self.scenario = scenario
        self.emu = emu            # the emulated node (runtime/emulation/node.py)
        self.waiter = waiter
        self.reducer = None       # the worker's SlotReducer, whose collective this is
        self.gen = self.rank = -1
        self.members: list[str] = []
        self.step = 0             # the step being computed (0-based)
        self.round = 0            # collectives of this step so far
        self._ring: tuple[tuple[int, ...], ...] | None = None

    def generation(self, gen: int, rank: int, members: list[str]) -> None:
        self.gen, self.rank, self.members = gen, rank, members
        self._ring = None

    def begin_step(self, step: int) -> None:
        self.step, self.round = step, 0

    def _ring_ranks(self) -> tuple[tuple[int, ...], ...]:
        """This generation's ranks grouped by region, in ring order (keel.hardware.ring_members)."""
        if self._ring is None:
            from keel import hardware
            index = {n: i for i, n in enumerate(self.members)}
            self._ring = tuple(tuple(index[n] for n in grp) for grp in hardware.ring_members(self.scenario, self.members))
        return self._ring

    def connect(self, pg, should_abort) -> None:
        """gloo connects a pair lazily, on its first message; the reduction's pairs are
        connected here, with the group (real formation work), instead of inside the first step.
        A lazy connect waits in the store for the peer's address on the thread that posts the
        message, up to the group's timeout, and a peer that never formed this generation's
        group (it saw the generation's abort before its announcement, or died) publishes none:
        so the connects run on a thread of their own while this one watches for the abort
        (waiting.run_watched). Posted here, they sat out 120 s unaborted, and the members
        still forming the group were lost for not leaving it (sweep member 3/8, 7 Dec)."""
        from runtime.emulation import hier
        r = self.reducer
        vectors = [(n, r.dtype if op == "sum" else torch.uint8) for op, n, _ in r.wire_rounds()]
        if r.block is None:
            vectors.append((r.layout.segments + 1, torch.float32))  # the int64 format's fallback maxima
        ring, rank = self._ring_ranks(), self.rank

        def pairs() -> None:
            waiter = Waiter()  # its own: the worker's is the training thread's
            for k, (length, dtype) in enumerate(vectors):
                plan = hier.plan_for(ring, length, dtype == torch.uint8)
                hier.run_plan(pg, rank, plan, torch.zeros(length, dtype=dtype),
                              "sum", 0.0, lambda step, msg, t: 0.0, should_abort, waiter, tag_base=(8 + k) * 4096)
        run_watched(pairs, should_abort, name="pair-connect")

    def collective(self, pg, t: torch.Tensor, op: str, should_abort) -> torch.Tensor:
        """One all-reduce of the emulated cluster: the hierarchical plan over this generation's
        regions (keel.hardware.ring_members; the block formats' exponents in one exchange across
        regions, keel.wire.scenario_rounds), every message priced by the link emulator at the
        bytes it really carries, scaled from the small model to the scenario's (`wire_scale`)."""
        from runtime.emulation import hier
        emu = self.emu
        pricer = emu.pricer
        pricer.bytes_per_element = t.element_size() * wire_scale(self.scenario, self.reducer, op, t.numel())
        pricer.key = f"g{self.gen}/s{self.step}/r{self.round}"
        plan = hier.plan_for(self._ring_ranks(), t.numel(), t.dtype == torch.uint8)  # exponents: keel.wire
        emu.c = hier.run_plan(pg, self.rank, plan, t, op, emu.c, pricer,
                              should_abort, self.waiter, tag_base=(self.round % 8) * 4096)
        self.round += 1
        return t


def wire_scale(scenario, reducer, op: str, elements: int) -> float:
    """Elements of the scenario's model one element of this message's vector (`elements` long,
    all-reduced with `op`) stands for: keel.wire's round of the same op for the scenario's
    parameters over the small model's (a vector no round of the rule has, the int64 format's
    fallback maxima, stands for itself), so a common step is priced at keel.wire.scenario_bytes."""
    from keel import wire
    w = scenario.workload
    big = {o: n for o, n, _ in wire.rounds(w.params, reducer.fmt, w.gradient_dtype, scenario.slot_count)}
    small = {o: n for o, n, _ in reducer.wire_rounds()}
    return big[op] / small[op] if small.get(op) == elements else 1.0
