"""The worker's state (a mixin of runtime.worker.Worker): weights and AdamW state sent from a
live peer to the members that are behind, bit-exact, and a checkpoint loaded into them."""
from __future__ import annotations

import torch

from runtime.reduction import broadcast


class StateMixin:
    def _state_tensors(self, with_optimizer: bool) -> list[torch.Tensor]:
        out = [p.data for p in self.params]
        if with_optimizer:
            for p in self.params:
                st = self.optimizer.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                out += [st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)]
        return out

    def _transfer_state(self, g: int, rank: int, source: int, behind: list[int], should_abort,
                        loaded: bool = False) -> None:
        """Weights and AdamW state from the live peer `source` to the members that are behind
        (a hot spare, a returning straggler), in one flat float32 tensor (bytes copied, so
        bit-exact), broadcast in a group of just those ranks: members already at the start step
        take no part.

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
        head = torch.tensor([float(bool(self.optimizer.state)), clock], dtype=torch.float64, device=self.device)
        self.at = f"gen {g}: state broadcast, {who}, party {party}: optimizer flag"
        broadcast(pg, head, 0, should_abort, self.waiter)
        head = head.cpu()
        has_opt = head[:1]
        tensors = self._state_tensors(bool(has_opt.item()))
        flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).to(self.device)
        self.at = f"gen {g}: state broadcast, {who}, party {party}: {flat.numel()} values"
        broadcast(pg, flat, 0, should_abort, self.waiter)
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
        if not has_opt.item():
            self.optimizer.state.clear()

    def _load_checkpoint(self, path: str) -> None:
        from runtime import checkpoint as ck
        loaded = ck.load_checkpoint(path, config_hash=self.run_info["config_hash"],
                                    config=self.run_info["scenario"],
                                    allow_config_change=bool(self.run_info.get("allow_config_change")))
        loaded.apply_to(self.model, self.optimizer)
        ck.restore_rng(loaded.rng)
        if self.emu is not None:  # this node's share, at the scenario's read bandwidth
            self.emu.c += self.emu.storage_s(len(self.members), self.scenario.checkpoint.read_gbyte_s)
