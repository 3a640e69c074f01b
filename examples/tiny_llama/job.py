"""A Hugging Face `transformers` causal LM under keel: a Llama configuration scaled down to a
few hundred thousand parameters, random initialisation from the seed (nothing downloaded), on
a token file (flat uint16 ids, nanoGPT's format) generated here at first use.

    keel run examples/tiny_llama/scenario.toml

The token file is a deterministic synthetic language (a sparse Markov chain over the
vocabulary, from numpy's seeded generator), so every machine builds the same bytes and keel's
content hash (runtime.job.TokenFile.version) is the same everywhere.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from runtime.job import Job, TokenFile, write_token_file

HERE = Path(__file__).resolve().parent


def token_file(config) -> Path:
    """The token file `config["tokens"]` names (relative to this directory), generated at first
    use: `config["token_count"]` ids of a Markov chain in which each token has 4 likely successors."""
    path = HERE / config["tokens"]
    if not path.exists():
        vocab, n = int(config["vocab_size"]), int(config["token_count"])
        rng = np.random.default_rng(int(config["token_seed"]))
        successors = rng.integers(0, vocab, size=(vocab, 4))
        choice = rng.integers(0, 4, size=n)
        ids = np.empty(n, dtype=np.int64)
        ids[0] = 0
        for i in range(1, n):
            ids[i] = successors[ids[i - 1], choice[i]]
        write_token_file(path, ids, "uint16")
    return path


def dataset(config):
    return TokenFile(token_file(config), context=int(config["context"]), dtype="uint16")


def model(seed: int, config) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                      intermediate_size=config["intermediate_size"], num_hidden_layers=config["layers"],
                      num_attention_heads=config["heads"], num_key_value_heads=config["kv_heads"],
                      max_position_embeddings=config["context"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG: seed it, then put it back
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def optimizer(named_params, config) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named_params], lr=config["lr"], weight_decay=config["weight_decay"],
                             foreach=False, fused=False)


def scheduler(opt, config):
    warmup = int(config["warmup_steps"])
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))


def loss(model: torch.nn.Module, batch, generator: torch.Generator) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def job() -> Job:
    return Job(model=model, optimizer=optimizer, scheduler=scheduler, loss=loss, dataset=dataset)
