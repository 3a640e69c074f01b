"""The worker's state (a mixin of runtime.worker.Worker): weights, optimizer state and the
job's further state sent from a live peer to the members that are behind, bit-exact, and a
checkpoint loaded into them."""
from __future__ import annotations

import torch

from runtime.reduction import broadcast


def state_blob(optimizer, model, extra) -> bytes:
    """The optimizer's state and the job's further state as bytes (flatten_optimizer's JSON
    meta, length-prefixed, then its tensors as safetensors): any optimizer, bit-exact."""
    import json
    from safetensors.torch import save
    from runtime.train_state import flatten_optimizer
    tensors, meta = flatten_optimizer(optimizer, model, extra)
    head = json.dumps(meta, allow_nan=False).encode()
    return len(head).to_bytes(8, "little") + head + save(tensors)


def load_state_blob(blob: bytes, optimizer, extra) -> None:
    import json
    from safetensors.torch import load
    from runtime.checkpoint_read import apply_optimizer_state
    from runtime.train_state import unflatten_optimizer
    n = int.from_bytes(blob[:8], "little")
    state = unflatten_optimizer(load(blob[8 + n:]), json.loads(blob[8:8 + n]))
    apply_optimizer_state(optimizer, state, extra)


class StateMixin:
    def _transfer_state(self, g: int, rank: int, source: int, behind: list[int], should_abort,
                        loaded: bool = False) -> None:
        """Weights, optimizer state and the job's further state from the live peer `source` to the
        members that are behind (a hot spare, a returning straggler): the weights in one flat
        float32 tensor (an exact widening), the rest as bytes (state_blob), broadcast in a group
        of just those ranks: members already at the start step take no part.

        Emulated: the source's clock goes with the optimizer flag, and each receiver's clock
        moves to the arrival of its share of the scenario's state (node.state_arrivals), or,
        after a checkpoint load (`loaded`: every member reads its share in parallel), to the
        source's clock, which includes the read."""
        party = [source] + sorted(r for r in behind if r != source)
        if rank not in party:
            return
        who = "sending" if rank == source else "receiving"
        self.at = f"gen {g}: state broadcast, {who}, party {party}: forming its group"
        pg = self.groups.make(g, party.index(rank), len(party), prefix=f"gen{g}/state/")
        clock = self.emu.c if self.emu is not None else 0.0
        blob = state_blob(self.optimizer, self.model, self.job.extra) if rank == source else b""
        head = torch.tensor([float(len(blob)), clock], dtype=torch.float64, device=self.device)
        self.at = f"gen {g}: state broadcast, {who}, party {party}: its size"
        broadcast(pg, head, 0, should_abort, self.waiter)
        head = head.cpu()
        tensors = [p.data for p in self.params]
        flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).to(self.device)
        self.at = f"gen {g}: state broadcast, {who}, party {party}: {flat.numel()} weights"
        broadcast(pg, flat, 0, should_abort, self.waiter)
        state = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if rank == source
                 else torch.empty(int(head[0]), dtype=torch.uint8)).to(self.device)
        self.at = f"gen {g}: state broadcast, {who}, party {party}: {state.numel()} bytes of optimizer state"
        broadcast(pg, state, 0, should_abort, self.waiter)
        if rank == source:
            return
        if self.emu is not None:
            c_src = float(head[1])
            if loaded:
                self.emu.c = max(self.emu.c, c_src)
            else:
                receivers = {self.members[r]: len(self.slot_map[self.members[r]]) for r in behind if r != source}
                arrival = self.emu.state_arrivals(c_src, self.members[source], receivers, f"g{g}")[self.node]
                self.emu.c = max(self.emu.c, self.emu.now(), arrival)
        flat = flat.cpu()
        with torch.no_grad():
            off = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t).to(t.dtype))
                off += n
        load_state_blob(state.cpu().numpy().tobytes(), self.optimizer, self.job.extra)

    def _load_checkpoint(self, path: str) -> None:
        from runtime import checkpoint as ck
        loaded = ck.load_checkpoint(path, config_hash=self.run_info["config_hash"],
                                    config=self.run_info["scenario"],
                                    allow_config_change=bool(self.run_info.get("allow_config_change")))
        loaded.apply_to(self.model, self.optimizer, self.job.extra)
        ck.restore_rng(loaded.rng)
        if self.emu is not None:  # this node's share, at the scenario's read bandwidth
            self.emu.c += self.emu.storage_s(len(self.members), self.scenario.checkpoint.read_gbyte_s)
