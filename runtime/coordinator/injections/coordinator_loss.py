"""`coordinator_loss`: this process dies by a real SIGKILL, its state saved (snapshot.py);
the supervisor replaces it with a successor (succession.py), which opens nothing new: the
episode was opened here and is in the snapshot."""
from __future__ import annotations

import os
import signal
from typing import Any, NoReturn

from runtime.coordinator import snapshot


def fire(coord: Any, p: Any, planned: int) -> NoReturn:
    coord.new_episode(p.cls, p.target, mode="kill", pid=os.getpid(), planned=planned)
    snapshot.save(coord)
    coord.sup.send({"type": "dying", "why": f"the scheduled {p.cls} at step {p.at_step}"})
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL")
