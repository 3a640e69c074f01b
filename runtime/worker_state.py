"""The worker's state: weights, optimizer state and the job's further state sent from a live
peer to the members that are behind, bit-exact, and a checkpoint loaded into them. Functions
of the Worker (runtime/worker.py): its job, group factory and emulated clock."""
from __future__ import annotations

import torch

from runtime.waiting import broadcast


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


def transfer_state(w, g: int, rank: int, source: int, behind: list[int], should_abort, loaded: bool = False) -> None:
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
    w.at = f"gen {g}: state broadcast, {who}, party {party}: forming its group"
    pg = w.groups.make(g, party.index(rank), len(party), prefix=f"gen{g}/state/")
    clock = w.emu.c if w.emu is not None else 0.0
    blob = state_blob(w.optimizer, w.model, w.job.extra) if rank == source else b""
    head = torch.tensor([float(len(blob)), clock], dtype=torch.float64, device=w.device)
    w.at = f"gen {g}: state broadcast, {who}, party {party}: its size"
    broadcast(pg, head, 0, should_abort, w.waiter)
    head = head.cpu()
    tensors = [p.data for p in w.params]
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).to(w.device)
    w.at = f"gen {g}: state broadcast, {who}, party {party}: {flat.numel()} weights"
    broadcast(pg, flat, 0, should_abort, w.waiter)
    state = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if rank == source
             else torch.empty(int(head[0]), dtype=torch.uint8)).to(w.device)
    w.at = f"gen {g}: state broadcast, {who}, party {party}: {state.numel()} bytes of optimizer state"
    broadcast(pg, state, 0, should_abort, w.waiter)
    if rank == source:
        return
    if w.emu is not None:
        c_src = float(head[1])
        if loaded:
            w.emu.c = max(w.emu.c, c_src)
        else:
            receivers = {w.members[r]: len(w.slot_map[w.members[r]]) for r in behind if r != source}
            arrival = w.emu.state_arrivals(c_src, w.members[source], receivers, f"g{g}")[w.node]
            w.emu.c = max(w.emu.c, w.emu.now(), arrival)
    flat = flat.cpu()
    with torch.no_grad():
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t).to(t.dtype))
            off += n
    load_state_blob(state.cpu().numpy().tobytes(), w.optimizer, w.job.extra)


def load_checkpoint(w, path: str) -> None:
    """The checkpoint at `path` into this worker (its RNG too); emulated, at the read bandwidth."""
    from runtime import checkpoint as ck
    loaded = ck.load_checkpoint(path, config_hash=w.run_info["config_hash"],
                                config=w.run_info["scenario"],
                                allow_config_change=bool(w.run_info.get("allow_config_change")))
    loaded.apply_to(w.model, w.optimizer, w.job.extra)
    ck.restore_rng(loaded.rng)
    if w.emu is not None:  # this node's share, at the scenario's read bandwidth
        w.emu.c += w.emu.storage_s(len(w.members), w.scenario.checkpoint.read_gbyte_s)
