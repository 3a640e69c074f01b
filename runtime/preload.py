"""Imported once by the fork server that `keel run` forks its workers from: it pays torch's
one-time costs (imports, lazily loaded modules behind the meta device and the first
forward/backward) so every forked worker starts warm. Single-threaded on purpose: no thread
pool may exist in a process that forks."""
import torch
import torch.distributed  # noqa: F401

torch.set_num_threads(1)

from keel.scenario import Model  # noqa: E402
from runtime import checkpoint, data, worker  # noqa: E402,F401
from runtime.model import build_model, build_optimizer, slot_loss  # noqa: E402


def _warm_up() -> None:
    cfg = Model(d_model=8, layers=1, heads=2, context=4)
    model = build_model(cfg, 0)
    opt = build_optimizer(model, cfg)
    x = torch.zeros((1, 4), dtype=torch.long)
    slot_loss(model, x, x, torch.ones(1)).backward()
    opt.step()


_warm_up()
