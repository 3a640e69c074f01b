"""Not a language model: a small ResNet with GroupNorm (plain PyTorch) classifying a generated
image set, under keel. GroupNorm, not BatchNorm: BatchNorm's running statistics are buffers the
forward pass writes, which depend on which slots a worker holds, so keel refuses them unless a
job declares `mutable_buffers="discard"` (docs/job-api.md).

    keel run examples/resnet_groupnorm/scenario.toml

The images need no file: image i of class i % classes is that class's fixed pattern (drawn
once from the data seed) plus noise drawn from a generator seeded with (data seed, i), so
`dataset[i]` is a pure function of i and the config.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.job import Job


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(groups, c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(h)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, widths: list[int], classes: int, groups: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.GroupNorm(groups, widths[0]), nn.ReLU())
        blocks, c = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(Block(c, w, 1 if i == 0 else 2, groups))
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class Patterns:
    """`size` images 3 x side x side, labels i % classes (map-style; its `version` a function of the config)."""

    def __init__(self, config) -> None:
        self.size, self.classes, self.side = int(config["images"]), int(config["classes"]), int(config["side"])
        self.seed, self.noise = int(config["data_seed"]), float(config["noise"])
        g = torch.Generator().manual_seed(self.seed)
        self.patterns = torch.randn(self.classes, 3, self.side, self.side, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = i % self.classes
        image = self.patterns[label] + self.noise * torch.randn(3, self.side, self.side, generator=g)
        return {"image": image, "label": torch.tensor(label)}


def model(seed: int, config) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # nn's default init draws from the global RNG: seed it, then put it back
        torch.manual_seed(seed)
        return ResNet(list(config["widths"]), int(config["classes"]), int(config["groups"]))


def optimizer(named_params, config) -> torch.optim.Optimizer:
    # SGD with momentum keeps no first moment (exp_avg): keel agrees the reduction's exponents
    # in a round of their own instead of from a priori bounds; the result is the same
    return torch.optim.SGD([p for _, p in named_params], lr=config["lr"], momentum=config["momentum"],
                           weight_decay=config["weight_decay"], foreach=False)


def loss(model: nn.Module, batch, generator: torch.Generator) -> torch.Tensor:
    image = batch["image"]
    flip = torch.rand(image.shape[0], generator=generator, device=image.device) < 0.5  # augmentation: keel's RNG
    image = torch.where(flip[:, None, None, None], image.flip(-1), image)
    return F.cross_entropy(model(image), batch["label"])


def job() -> Job:
    return Job(model=model, optimizer=optimizer, loss=loss, dataset=Patterns)
