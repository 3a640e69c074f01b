"""The peers' training script for bench/peers.py: the scenario's job through keel's job API
(runtime/job_run.py; peers-4.toml's is the built-in GPT), keel's data, one slot per worker, run
the way each peer is meant to be run.

    # plain DDP (the baseline) and torchrun elastic (checkpoint every N steps, resume on restart)
    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 1 \
        bench/peers_train.py --mode torchrun --out DIR [--checkpoint-every 10] [--kill-at 15]
    # torchft: one replica group of one worker per slot, each under its own torchrun
    TORCHFT_LIGHTHOUSE=http://HOST:PORT python -m torch.distributed.run --standalone ... \
        bench/peers_train.py --mode torchft --replica 1 --replicas 4 --out DIR

Every process appends JSON lines to DIR/log-<slot>.jsonl: `start` (pid, attempt), one `commit`
per committed step (its number, wall time, loss bits, the sample indices it trained on, whether
it took part), `kill` (the wall time just before worker `--kill-rank` SIGKILLs itself once
`--kill-at` steps are committed, first attempt only) and `end` (final weights sha256). The
harness derives every figure from these lines.

`--trace` (torchrun mode) adds a `trace` line per step: digests of the gradients each rank
computed (before DDP's all-reduce: a plain copy of the model on the same batch), of the reduced
gradients and of the weights after the step, and whether DDP has rebuilt its buckets; rank 0
also saves the local and reduced gradients of every step to DIR/grads-<step>-a<attempt>.pt.
`--ddp-kwargs` passes DistributedDataParallel's keyword arguments (bench/peers.py --resume-trace).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import signal
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keel.scenario import load  # noqa: E402
from runtime.job import slot_generator  # noqa: E402
from runtime.job_run import BoundJob, load_spec  # noqa: E402
from runtime.train_state import weights_sha256  # noqa: E402

SCENARIO = Path(__file__).with_name("peers-4.toml")


class Log:
    def __init__(self, out: Path, slot: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.f = open(out / f"log-{slot}.jsonl", "a", buffering=1)

    def write(self, **rec) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())  # the line survives the SIGKILL that may follow


def loss_bits(x: float) -> str:
    return struct.pack("<f", x).hex()


def setup(args):
    """The scenario's job (runtime/job_run.py: the built-in GPT without [job]), its model and
    optimizer built, its samples drawn by keel's sampler."""
    torch.set_num_threads(1)
    sc = load(args.scenario, args.set)
    job = BoundJob(load_spec(sc), sc)
    return sc, job, job.model


def loss_of(job: BoundJob, model, step: int, slot: int):
    """The job's loss of (step, slot) on `model` (the job's own, or a DDP wrapper of it)."""
    b = job.loader.batch(step, slot)
    return job.spec.job.loss(model, b.data, slot_generator(job.seed, step, slot))


def maybe_kill(args, log: Log, slot: int, committed: int, attempt: int) -> None:
    """Worker `--kill-rank` SIGKILLs itself in the step after `--kill-at` commits, after its
    forward pass (first attempt only), as keel's coordinator kills a worker mid-step."""
    if attempt == 0 and slot == args.kill_rank and committed == args.kill_at:
        log.write(kind="kill", t=time.time(), step=committed)
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- DDP / torchrun elastic

def flat_grads(model) -> torch.Tensor:
    """Every parameter's gradient, in sorted-name order, as one vector."""
    return torch.cat([p.grad.reshape(-1) for _, p in sorted(model.named_parameters())])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]



def init_group(dist, rank: int, world: int, attempt: int) -> None:
    """The default group on the agent's store under a prefix of its own per attempt.

    Workaround (bench/peers.py says so): with torch 2.13.0, `init_process_group("gloo")` in the
    workers torchrun restarts reads the first attempt's gloo addresses from the agent's store
    (the same TCPStore across restarts, keys unprefixed), so the relaunched group tries to
    connect to dead ports ("Gloo connectFullMesh failed ... Connection refused") or hangs."""
    from datetime import timedelta
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"peers-attempt-{attempt}", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))


def run_ddp(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sc, job, model = setup(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = Log(args.out, rank)
    log.write(kind="start", t=time.time(), pid=os.getpid(), attempt=attempt)
    init_group(dist, rank, world, attempt)
    optimizer = job.optimizer
    ckpt = args.out / "ckpt.pt"
    start = 0
    if args.checkpoint_every and ckpt.exists():  # resume: every rank reads the newest checkpoint
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        if not args.resume_weights_only:
            optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
        if args.trace:
            log.write(kind="resumed", step=start, attempt=attempt, weights=weights_sha256(model)[:16])
    ddp = DDP(model, **json.loads(args.ddp_kwargs))
    for step in range(start, sc.run.steps):
        if args.trace:  # this rank's own gradients, before any reduction
            plain = copy.deepcopy(model)
            loss_of(job, plain, step, rank).backward()
            local = flat_grads(plain)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(job, ddp, step, rank)
        maybe_kill(args, log, rank, step, attempt)  # mid-step: the others are in the all-reduce
        loss.backward()  # DDP averages the gradients over the 4 ranks
        if args.trace:
            reduced = flat_grads(model)
            trace = {"local": digest(local), "reduced": digest(reduced),
                     "rebuilt": ddp._get_ddp_logging_data().get("has_rebuilt_buckets")}
            if rank == 0:
                torch.save({"local": local, "reduced": reduced}, args.out / f"grads-{step + 1}-a{attempt}.pt")
        optimizer.step()
        if args.trace:
            log.write(kind="trace", step=step + 1, attempt=attempt, weights=weights_sha256(model)[:16], **trace)
        log.write(kind="commit", step=step + 1, t=time.time(), slots=[rank],
                  samples=job.loader.sampler.indices(step, rank), loss=loss_bits(loss.item()), part=True)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                torch.save({"step": step + 1, "model": model.state_dict(), "optim": optimizer.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, ckpt)
    log.write(kind="end", t=time.time(), sha=weights_sha256(model), step=sc.run.steps)
    # no destroy_process_group: main() leaves with os._exit (nothing is in flight after the last step)


# ----------------------------------------------------------------------------- torchft

def patch_torchft_comm_hook() -> None:
    """Workaround (bench/peers.py says so): torchft 0.2.0's DDP comm hook asserts `fut._fut`
    after `work.wait()`, but when the all-reduce failed (a peer died) `wait()` has reported the
    error to the manager and returned False without setting `_fut`, so the AssertionError
    kills every survivor and torchrun restarts them all from step 0. The patched hook returns
    the bucket as it is in that case; the manager has the error, so the step is not committed."""
    import torchft.ddp

    def comm_hook(state, bucket):
        work = state.allreduce(bucket.buffer())
        ok = work.wait()
        fut = getattr(work.get_future(), "_fut", None)
        if ok is False or fut is None:
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return fut

    torchft.ddp.DistributedDataParallel._comm_hook = staticmethod(comm_hook)


def run_torchft(args) -> None:
    from datetime import timedelta

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    patch_torchft_comm_hook()

    sc, job, model = setup(args)
    slot = args.replica
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = Log(args.out, slot)
    log.write(kind="start", t=time.time(), pid=os.getpid(), attempt=attempt)
    inner = job.optimizer

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.torchft_timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.replicas - 1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"keel_peer_{slot}", timeout=timeout, quorum_timeout=timedelta(seconds=60),
                      rank=0, world_size=1)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    if attempt == 0:  # harness: all replicas in the first quorum (see bench/peers.py, workarounds)
        (args.out / f"ready-{slot}").touch()
        while sum(1 for _ in args.out.glob("ready-*")) < args.replicas:
            time.sleep(0.02)
    while manager.current_step() < sc.run.steps:
        step = manager.current_step()
        optimizer.zero_grad(set_to_none=True)  # starts the quorum (async)
        loss = loss_of(job, ddp, step, slot)
        if attempt == 0 and slot == args.kill_rank and step == args.kill_at:
            manager.wait_quorum()  # the victim is in the step's quorum: the others will all-reduce with it
            maybe_kill(args, log, slot, step, attempt)
        loss.backward()  # torchft's DDP: all-reduce over the quorum's participants
        optimizer.step()  # applies only if the manager says the step may commit
        if manager.current_step() > step:
            log.write(kind="commit", step=manager.current_step(), t=time.time(), slots=[slot],
                      samples=job.loader.sampler.indices(step, slot), loss=loss_bits(loss.item()),
                      part=manager.is_participating(), n=manager.num_participants())
    log.write(kind="end", t=time.time(), sha=weights_sha256(model), step=manager.current_step())
    manager.shutdown(wait=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("torchrun", "torchft"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scenario", default=str(SCENARIO))
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: plain DDP, no checkpoints")
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL --kill-rank once this many steps are committed")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--resume-weights-only", action="store_true",
                   help="resume the weights but not the optimizer state (a tool that must not match its fault-free run)")
    p.add_argument("--trace", action="store_true", help="log digests of each step's gradients and weights")
    p.add_argument("--ddp-kwargs", default="{}", help="DistributedDataParallel's keyword arguments, as JSON")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--torchft-timeout", type=float, default=5.0)
    args = p.parse_args()
    (run_ddp if args.mode == "torchrun" else run_torchft)(args)
    os._exit(0)  # torchft's manager threads and gloo's can hold the interpreter at exit


if __name__ == "__main__":
    main()
