"""A stall explains itself: what each worker last said, as lines of text."""
from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence


def _brief(msg: dict) -> str:
    keys = ("gen", "step", "committed", "error")
    return msg.get("type", "?") + "".join(f" {k}={msg[k]}" for k in keys if k in msg)


def stall_report(*, stall: float, phase: str, gen: int, committed: int, gen_start_step: int,
                 nodes: Sequence[str], workers: Mapping[str, Any], members: Sequence[str],
                 next_reports: Collection[str], pending_acks: Collection[str], now: float) -> list[str]:
    """Per worker: its role, committed step, whether it got through the current generation's
    set-up (`ready`), its report of the next step, an unacknowledged abort, its last message
    other than a heartbeat, and where its own heartbeat says it is."""
    lines = [f"no progress for {stall:.0f} s (phase {phase}, generation {gen}, "
             f"committed {committed}, start step {gen_start_step}); workers:"]
    for n in nodes:
        w = workers.get(n)
        if w is None:
            lines.append(f"  {n}: never started")
            continue
        rank = members.index(n) if n in members else None
        parts = [f"  {n}: {w.role}" + (f" rank {rank}" if rank is not None else ""),
                 "alive" if w.alive else "dead", f"committed {w.committed}"]
        if rank is not None:
            parts.append("ready" if w.ready_gen >= gen else "NOT ready (group/state set-up)")
            parts.append(f"reported step {committed + 1}" if n in next_reports else f"no report of step {committed + 1}")
        if n in pending_acks:
            parts.append("abort not acknowledged")
        if w.last_msg is not None:
            parts.append(f"last message '{_brief(w.last_msg)}' {now - w.last_msg_t:.1f} s ago")
        if w.last_hb_t:
            parts.append(f"heartbeat {now - w.last_hb_t:.1f} s ago")
        if w.at:
            parts.append(f"at: {w.at}")
        lines.append(", ".join(parts))
    return lines
