"""Issue 13, checkpoints and storage: SIGKILL at random moments of checkpoint writes, every kind of
damage to every file, hostile checkpoints, unwritable and full output directories.

Counts: FULL under KEEL_RELIABILITY=full (`make reliability`), REDUCED in `make test`. Each test
records its trials, faults survived, bad inputs tried and losses (the `record` fixture).

What the SIGKILL torture proves is the commit protocol (files written and fsynced, manifest last,
rename, directory fsynced) under a real SIGKILL at a seeded moment: a chain of real child
processes runs keel's own writer (`AsyncCheckpointer`, as the worker does) in a loop, each
resumed by keel's own reader from what the previous one left, each killed: either by itself at a
seeded count of the protocol's steps (every boundary: before and after each file, fsync, rename,
removal), or by the parent at a seeded delay into a seeded checkpoint's write (anywhere, also in
the middle of a write). A few whole `keel run` jobs are killed the same way and resumed.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import pickle
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SCENARIOS, keel_cmd, reliability_count
from keel import ckpt_reader
from runtime import checkpoint as ck
from runtime.model import build_model, build_optimizer, tensor_bytes, weights_sha256
from test_checkpoint import CONFIG_HASH, TINY, save, train
from test_ckpt_reader import reseal

pytestmark = pytest.mark.reliability
torch.set_num_threads(1)

CONFIG = {"model": {"lr": 0.001}}


# ----------------------------------------------------------------------------- shared

def digest(weights, opt_state, rng) -> str:
    """One sha256 over the state a checkpoint must carry exactly: weights, optimizer tensors,
    the python, numpy and torch RNG states."""
    h = sha256(weights_sha256(weights).encode())
    for idx in sorted(opt_state, key=int):
        for key in sorted(opt_state[idx]):
            v = opt_state[idx][key]
            h.update(f"{idx}.{key}\0".encode())
            h.update(tensor_bytes(v) if torch.is_tensor(v) else json.dumps(v).encode())
    h.update(json.dumps({"python": rng["python"], "numpy": rng["numpy"]}, sort_keys=True).encode())
    h.update(tensor_bytes(rng["torch_cpu"]))
    return h.hexdigest()


def live_digest(model, opt) -> str:
    return digest(model.state_dict(), opt.state_dict()["state"], ck.capture_rng())


def loaded_digest(loaded: ck.LoadedCheckpoint) -> str:
    return digest(loaded.weights, loaded.optimizer_state["state"], loaded.rng)


def step_dirs(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if ck.STEP_DIR.match(p.name)) if run.is_dir() else []


def leftovers(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if ck.TMP_DIR.match(p.name)) if run.is_dir() else []


# ----------------------------------------------------------------------------- the writer child

def _send(fd: int, **msg) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())  # a pipe: the parent has it even if we die next


def _label(a) -> str:
    """What a protocol step acts on: a file's name, or the kind of directory."""
    name = Path(a[0]).name
    return name if not name.startswith((".", "step-")) else name.split("-")[0].lstrip(".") + "-dir"


# every step of the commit protocol, as the hooks below name them: a kill lands at each in turn
PROTOCOL_POINTS = tuple(
    [f"{when} write+fsync {f}" for f in (*ck.FILES, ck.MANIFEST) for when in ("before", "after")]
    + [f"{when} {what}" for what in ("fsync tmp-dir", "rename tmp-dir", "fsync run", "exchange tmp-dir",
                                     "remove tmp-dir", "rename step-dir", "remove trash-dir")
       for when in ("before", "after")])


def _install_kill_hooks(kill_at: str, fd: int) -> None:
    """Name every step of the commit protocol (before and after each file written and fsynced,
    each directory fsync, rename, exchange and removal) and SIGKILL this process the first time
    the step `kill_at` is reached."""
    def hook(where: str) -> None:
        if where == kill_at:
            _send(fd, kind="kill", where=where)
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn, what):
        def wrapped(*a, **k):
            hook(f"before {what} {_label(a)}")
            out = fn(*a, **k)
            hook(f"after {what} {_label(a)}")
            return out
        return wrapped

    ck.write_synced = wrap(ck.write_synced, "write+fsync")
    ck.fsync_dir = wrap(ck.fsync_dir, "fsync")
    ck._replace_dir = wrap(ck._replace_dir, "exchange")
    os.rename = wrap(os.rename, "rename")
    shutil.rmtree = wrap(shutil.rmtree, "remove")


def _writer_child(run: Path, total: int, kill_at: str | None, fd: int, write: bool = True) -> None:
    """A real process: resume from the newest complete checkpoint in `run` (keel's reader), then
    train and checkpoint every step (keel's writer, async as in the worker; every fourth step's
    checkpoint written twice, as a redone step's is) until `total` or until killed."""
    code = 1
    try:
        torch.set_num_threads(1)
        model = build_model(TINY, seed=7)
        opt = build_optimizer(model, TINY)
        latest = ck.find_latest(run)
        if latest is None:
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            start = 0
        else:
            loaded = ck.load_checkpoint(latest, config_hash=CONFIG_HASH, config=CONFIG)
            loaded.apply_to(model, opt)
            ck.restore_rng(loaded.rng)
            start = loaded.step
        _send(fd, kind="start", step=start)
        if kill_at is not None:
            _install_kill_hooks(kill_at, fd)
        writer = ck.AsyncCheckpointer(run, keep=3, on_done=lambda step, path, write_s, err: _send(
            fd, kind="done", step=step, ok=err is None, error=None if err is None else repr(err)))
        for s in range(start + 1, total + 1):
            train(model, opt, 1, s)
            _send(fd, kind="intent", step=s, digest=live_digest(model, opt))
            if not write:
                continue
            data = {"format": "keel-loader", "step": s, "seed": 0, "version": "v" * 64, "quarantine": []}
            for generation in ((1, 2) if s % 4 == 0 else (1,)):
                topology = {"generation": generation, "members": ["r0/0"], "slot_map": {"0": "r0/0"}}
                writer.snapshot_and_submit(s, model, opt, ck.capture_rng(), data, CONFIG_HASH, CONFIG, topology)
        writer.wait()
        _send(fd, kind="final", step=total, digest=live_digest(model, opt))
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        _send(fd, kind="error", error=f"{type(e).__name__}: {e}")
    finally:
        os._exit(code)


@functools.lru_cache(maxsize=1)
def _warm_up() -> None:
    """What each child would otherwise pay again (seconds of lazy initialisation under load),
    paid once in the parent before the forks: a model, a training step, the commit SHA."""
    ck.current_commit_sha()
    model = build_model(TINY, seed=7)
    opt = build_optimizer(model, TINY)
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    train(model, opt, 1, 0)
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


class Child:
    """A forked writer child and the messages it sent."""

    def __init__(self, run: Path, total: int, kill_at: str | None = None, write: bool = True) -> None:
        _warm_up()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(r)
            _writer_child(run, total, kill_at, w, write)
        os.close(w)
        self.pid, self.fd, self.buf, self.messages, self.status = pid, r, b"", [], None

    def _pump(self, timeout: float) -> bool:
        """Read what is there (waiting up to `timeout`); False at EOF."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return False
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        self.messages += [json.loads(x) for x in lines if x.strip()]
        return True

    def wait_for(self, pred, timeout: float = 60.0) -> dict | None:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for m in self.messages[seen:]:
                if pred(m):
                    return m
            seen = len(self.messages)
            if not self._pump(0.05):
                return next((m for m in self.messages[seen:] if pred(m)), None)
        raise AssertionError(f"child {self.pid}: nothing matched within {timeout} s; last messages {self.messages[-3:]}")

    def finish(self, timeout: float = 60.0) -> list[dict]:
        """Read to EOF and reap the child; its wait status in `self.status`."""
        deadline = time.monotonic() + timeout
        while self._pump(0.1):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                raise AssertionError(f"child {self.pid} still running after {timeout} s")
        os.close(self.fd)
        _, self.status = os.waitpid(self.pid, 0)
        errors = [m["error"] for m in self.messages if m["kind"] == "error"]
        assert not errors, f"writer child failed: {errors[0]}"
        return self.messages

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def killed(self) -> bool:
        return self.status is not None and os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL


# ----------------------------------------------------------------------------- SIGKILL torture

@pytest.mark.timeout(1200)
def test_sigkill_at_random_moments_of_checkpoint_writes(tmp_path, record):
    n = reliability_count(full=100, reduced=10)
    rng = random.Random(13)
    total = 5 * n + 12  # a kill comes at most 4 steps after a child's start: the chain never ends early
    ref = Child(tmp_path / "unused", total, write=False).finish()
    reference = {m["step"]: m["digest"] for m in ref if m["kind"] == "intent"}
    final_reference = next(m["digest"] for m in ref if m["kind"] == "final")
    assert reference[total] == final_reference

    run = tmp_path / "run"
    points = rng.sample(PROTOCOL_POINTS, len(PROTOCOL_POINTS))  # each in turn, in a seeded order
    where, torn_left, refused_dirs, ahead = [], set(), 0, 0
    for trial in range(n):
        by_hook = trial % 2 == 0
        kill_at = points[(trial // 2) % len(points)] if by_hook else None
        child = Child(run, total, kill_at=kill_at)
        try:
            start = child.wait_for(lambda m: m["kind"] in ("start", "error"))
            assert start["kind"] == "start", start
            if not by_hook:  # the parent kills: a seeded delay into a seeded checkpoint's write
                target = start["step"] + rng.randint(1, 3)
                child.wait_for(lambda m: m["kind"] == "intent" and m["step"] == target)
                time.sleep(rng.uniform(0.0, 0.12))
                child.kill()
            messages = child.finish()
        finally:
            child.kill()
        assert child.killed, f"trial {trial}: the writer was not killed ({messages[-3:]})"
        kill = next((m for m in messages if m["kind"] == "kill"), None)
        where.append(kill["where"] if kill else "signal")

        intents = {m["step"]: m["digest"] for m in messages if m["kind"] == "intent"}
        done = [m["step"] for m in messages if m["kind"] == "done" and m["ok"]]
        for s, d in intents.items():  # every step after a resume is the uninterrupted run's, bit for bit
            assert d == reference[s], f"trial {trial}: step {s} differs from the uninterrupted run after a resume"
        committed = max(done + [start["step"]])
        attempted = max(list(intents) + [start["step"]])

        # what the next resume sees: the newest complete checkpoint, exactly as it was written
        refused: list = []
        latest = ck.find_latest(run, refused)
        step = int(ck.STEP_DIR.match(latest.name).group(1)) if latest is not None else 0
        assert step >= committed, f"trial {trial}: checkpoint {committed} was committed, the newest complete is {latest}"
        assert step <= attempted
        if latest is not None:  # (none only while nothing was ever committed)
            assert loaded_digest(ck.load_checkpoint(latest, config_hash=CONFIG_HASH)) == reference[step], \
                f"trial {trial}: {latest} verified but does not hold step {step}'s state (torn)"
            assert ckpt_reader.verify(latest) == []
        for p in step_dirs(run):  # both readers agree on every directory
            assert (ck.verify_checkpoint(p) == []) == (ckpt_reader.verify(p) == []), p
        new_torn = {p.name for p in leftovers(run)} - torn_left
        torn_left |= new_torn
        refused_dirs += len(refused)
        ahead += step > committed
        record(trials=1, faults_survived=1, bad_inputs=len(refused) + len(new_torn))

    final = Child(run, total).finish()
    assert next(m["digest"] for m in final if m["kind"] == "final") == final_reference
    assert leftovers(run) == []  # the last writer removed what the killed ones left
    hit = set(where) - {"signal"}
    record.note("kills", f"{sum(w != 'signal' for w in where)} by the writer itself at a step of the commit protocol "
                         f"({len(hit)} of its {len(PROTOCOL_POINTS)} steps), {sum(w == 'signal' for w in where)} by the "
                         f"parent at a seeded moment into a checkpoint's write")
    record.note("after the kills", f"{len(torn_left)} torn writes left behind (never taken for checkpoints), "
                                   f"{refused_dirs} checkpoint directories refused, {ahead} resumes from a checkpoint "
                                   f"committed just before the kill; final weights equal the uninterrupted run's")


# ----------------------------------------------------------------------------- whole job

JOB = ["--steps", "12", "--set", "checkpoint.interval_steps=3"]  # local-8: checkpoints 3, 6, 9, 12; fault at step 8


def _keel_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(keel_cmd("run", str(SCENARIOS / "local-8.toml"), *JOB, *args), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


class Reference:
    """The uninterrupted run, started at once and waited for when first needed (it runs while a
    test kills its first job: the two share the machine, which changes no verdict)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(keel_cmd("run", str(SCENARIOS / "local-8.toml"), *JOB, "--out", str(out), "--json"),
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.summary: dict | None = None

    def get(self) -> tuple[Path, dict]:
        if self.summary is None:
            stdout, stderr = self.proc.communicate(timeout=400)
            assert self.proc.returncode == 0, stderr[-3000:]
            self.summary = json.loads(stdout)
        return self.out, self.summary


@pytest.fixture(scope="module")
def job_reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("job") / "uninterrupted")
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.communicate()


def _kill_job_during_write(out: Path, ckpt_step: int, delay_s: float, timeout: float = 180) -> None:
    """Start `keel run` in a session of its own; when the writer reports checkpoint `ckpt_step`
    started, wait `delay_s` and SIGKILL every process of the job."""
    proc = subprocess.Popen(keel_cmd("run", str(SCENARIOS / "local-8.toml"), *JOB, "--out", str(out)),
                            cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events, seen = out / "events.jsonl", b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if events.exists():
                seen = events.read_bytes()
                if any(json.loads(x).get("kind") == "checkpoint_start" and json.loads(x)["detail"].get("ckpt_step") == ckpt_step
                       for x in seen.split(b"\n")[:-1] if x.strip()):
                    time.sleep(delay_s)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                    return
            if proc.poll() is not None:
                raise AssertionError(f"keel run ended (rc {proc.returncode}) before checkpoint {ckpt_step}")
            time.sleep(0.002)
        raise AssertionError(f"no checkpoint {ckpt_step} within {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(1200)
def test_sigkill_whole_job_during_a_checkpoint_write_then_resume(tmp_path, job_reference, record):
    """`keel run` killed (every process of the job) at a seeded moment of a checkpoint write, then
    `keel run --resume`: it takes the newest complete checkpoint and ends bit-identical to the
    uninterrupted run. Every other trial (the first among them) also damages that newest
    checkpoint before the resume: the resume then says it refused it and falls back to the one
    before, and still ends bit-identical."""
    rng = random.Random(1313)
    n = reliability_count(full=6, reduced=1)
    mid_write, damaged = 0, []
    for trial in range(n):
        killed, resumed = tmp_path / f"killed-{trial}", tmp_path / f"resumed-{trial}"
        _kill_job_during_write(killed, rng.choice([6, 9]), rng.uniform(0.0, 0.06))
        ckpts = killed / "checkpoints"
        mid_write += bool(leftovers(ckpts))
        complete = [p for p in step_dirs(ckpts) if ckpt_reader.verify(p) == []]
        assert complete, f"trial {trial}: no complete checkpoint after the kill"
        expected, refused = complete[-1], None
        if trial % 2 == 0 and len(complete) >= 2:
            name, how = rng.choice([(f, h) for f in (*ck.FILES, ck.MANIFEST) for h in DAMAGES if h != "other-step-copy"])
            assert damage(complete[-1], name, how, complete[-2])
            expected, refused = complete[-2], complete[-1]
            damaged.append(f"{name} {how}")
        r = _keel_run("--out", str(resumed), "--resume", str(killed), "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        _, reference = job_reference.get()
        if refused is not None:
            assert f"checkpoint {refused} refused" in r.stderr and name in r.stderr, r.stderr[-2000:]
            assert f"falling back to {expected}" in r.stderr, r.stderr[-2000:]
        summary = json.loads(r.stdout)
        start = json.loads((resumed / "events.jsonl").read_text().splitlines()[0])
        assert start["detail"]["resume_from"] == str(expected), "the resume did not take the newest complete checkpoint"
        assert summary["start_step"] == int(expected.name[5:])
        assert summary["final_weights_sha256"] == reference["final_weights_sha256"]
        assert summary["losses"] == reference["losses"][summary["start_step"]:]
        assert summary["restarts"] == 0
        record(trials=1, faults_survived=1, bad_inputs=refused is not None)
    record.note("whole-job kills", f"{n} of local-8 (12 steps, a hardware fault at step 8), {mid_write} with a write in "
                                   f"flight at the kill; newest checkpoint then damaged before {len(damaged)} of the resumes "
                                   f"({'; '.join(damaged)}); every resume bit-identical to the uninterrupted run")


# ----------------------------------------------------------------------------- damage

DAMAGES = ("truncated", "flip-header", "flip-middle", "flip-end", "removed", "other-step-copy", "junk-appended")


def damage(ckpt: Path, name: str, how: str, other: Path) -> bool:
    """Damage file `name` of checkpoint `ckpt`; False when the damage changes nothing (another
    step's copy that is byte-identical: the checkpoint is then intact, and must verify)."""
    f = ckpt / name
    raw = f.read_bytes()
    if how == "truncated":
        f.write_bytes(raw[: len(raw) // 2])
    elif how.startswith("flip-"):
        at = {"flip-header": 3, "flip-middle": len(raw) // 2, "flip-end": len(raw) - 2}[how]
        flipped = bytearray(raw)
        flipped[at] ^= 0x20
        f.write_bytes(bytes(flipped))
    elif how == "removed":
        f.unlink()
    elif how == "other-step-copy":
        replacement = (other / name).read_bytes()
        if replacement == raw:
            return False
        f.write_bytes(replacement)
    elif how == "junk-appended":
        f.write_bytes(raw + b"\0junk\n")
    return True


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("damage") / "run"
    model = build_model(TINY, seed=1)
    opt = build_optimizer(model, TINY)
    for step in (2, 4):
        train(model, opt, 2, step)
        save(run, step, model, opt)
    return run


@pytest.mark.timeout(600)
def test_every_damage_to_every_file_is_refused_naming_it(two_checkpoints, tmp_path, capsys, record):
    identical = []
    for name in (*ck.FILES, ck.MANIFEST):
        for how in DAMAGES:
            run = tmp_path / f"{name}-{how}"
            shutil.copytree(two_checkpoints, run)
            newest, previous = run / "step-00000004", run / "step-00000002"
            if not damage(newest, name, how, previous):
                identical.append(name)
                assert ck.verify_checkpoint(newest) == [] and ckpt_reader.verify(newest) == []
                continue
            with pytest.raises(ck.CheckpointError, match=name.replace(".", r"\.")):
                ck.load_checkpoint(newest)
            problems = ckpt_reader.verify(newest)
            assert any(name in p for p in problems), (name, how, problems)
            capsys.readouterr()
            assert ck.resolve_resume(run) == previous
            err = capsys.readouterr().err
            assert f"checkpoint {newest} refused" in err and name in err and f"falling back to {previous}" in err, err
            assert ck.load_checkpoint(previous).step == 2
            record(trials=1, bad_inputs=1, faults_survived=1)
            shutil.rmtree(run)
    record.note("damages", f"{len(DAMAGES)} kinds x {len(ck.FILES) + 1} files; another step's copy of "
                           f"{', '.join(identical) or 'no file'} is byte-identical (an intact checkpoint, accepted)")


# ----------------------------------------------------------------------------- hostile input

_AUDIT: dict = {"on": False, "events": [], "installed": False}


def _audit(event: str, args: tuple) -> None:
    if _AUDIT["on"] and event in ("open", "os.listdir", "os.scandir"):
        _AUDIT["events"].append((event, args))


class Evil:
    """Unpickling this makes a directory: proof that something was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _header_file(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


def _hostile_cases(marker: Path):
    """(name, file it concerns, mutate(ckpt_dir, other_ckpt_dir)); each is resealed where a forger
    would reseal it, so only the readers' own rules stand between it and a load."""
    deep = b"[" * 100_000 + b"]" * 100_000

    def put(name, data, seal=True):
        def mutate(d, other):
            (d / name).write_bytes(data)
            if seal:
                reseal(d)
        return mutate

    def manifest_lists(entry):
        def mutate(d, other):
            m = json.loads((d / "manifest.json").read_text())
            m["files"][entry] = {"sha256": "0" * 64, "bytes": 4}
            (d / "manifest.json").write_text(json.dumps(m))
            _reseal_manifest_only(d)
        return mutate

    def symlink(target_of):
        def mutate(d, other):
            (d / "weights.safetensors").unlink()
            os.symlink(target_of(other), d / "weights.safetensors")
        return mutate

    def fifo(d, other):
        (d / "context.json").unlink()
        os.mkfifo(d / "context.json")

    def manifest_raw(data):
        def mutate(d, other):
            (d / "manifest.json").write_bytes(data)
        return mutate

    torch_pickle = Path(marker.parent / "evil.pt")
    torch.save({"w": Evil(marker)}, torch_pickle)
    w = "weights.safetensors"
    return [
        ("safetensors header length 2^64-1", w, put(w, _header_file(b"{}", length=2**64 - 1))),
        ("safetensors header length 2^30 in a small file", w, put(w, _header_file(b"{}", length=2**30))),
        ("safetensors header nested 100000 deep", w, put(w, _header_file(b'{"a":' + deep + b"}"))),
        ("safetensors header of 101 MiB", w, put(w, _header_file(b"{" + b" " * (101 * 2**20) + b"}"))),
        ("safetensors offsets not integers", w, put(w, _header_file(
            json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}).encode(), b"\0" * 4))),
        ("safetensors shape of 2^62 elements", w, put(w, _header_file(
            json.dumps({"w": {"dtype": "F32", "shape": [2**62], "data_offsets": [0, 4]}}).encode(), b"\0" * 4))),
        ("safetensors dtype an object", w, put(w, _header_file(
            json.dumps({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4))),
        ("tensors file is a pickle", w, put(w, pickle.dumps({"w": Evil(marker)}))),
        ("tensors file is a torch.save zip (pickle inside)", w, put(w, torch_pickle.read_bytes())),
        ("manifest names ../", "../step-00000002/weights.safetensors", manifest_lists("../step-00000002/weights.safetensors")),
        ("manifest names an absolute path", "/etc/passwd", manifest_lists("/etc/passwd")),
        ("manifest names a pickle file", "model.pt", manifest_lists("model.pt")),
        ("manifest names a file with a NUL", "a\\x00b", manifest_lists("a\0b")),
        ("manifest nested 100000 deep", "manifest.json", manifest_raw(b'{"a":' + deep + b"}")),
        ("manifest of 8 MB", "manifest.json", manifest_raw(b'{"format": "keel-checkpoint", "x": "' + b"x" * (8 << 20) + b'"}')),
        ("context.json nested 100000 deep", "context.json", put("context.json", b'{"a":' + deep + b"}")),
        ("rng_state.json with NaN", "rng_state.json", put("rng_state.json", b'{"python": NaN, "numpy": {}}')),
        ("weights a symlink to another step's", w, symlink(lambda other: other / "weights.safetensors")),
        ("weights a symlink out of the run", w, symlink(lambda other: Path("/etc/hostname"))),
        ("context.json a FIFO", "context.json", fifo),
    ]


def _reseal_manifest_only(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m.pop("manifest_sha256", None)
    canonical = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    m["manifest_sha256"] = sha256(canonical.encode()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.timeout(600)
def test_hostile_checkpoints_are_refused_and_nothing_outside_is_opened(two_checkpoints, tmp_path, record):
    if not _AUDIT["installed"]:
        sys.addaudithook(_audit)  # every open() and os.open() of this process, while "on"
        _AUDIT["installed"] = True
    marker = tmp_path / "EXECUTED"
    cases = _hostile_cases(marker)
    for i, (what, named, mutate) in enumerate(cases):
        run = tmp_path / f"case-{i}"
        shutil.copytree(two_checkpoints, run)
        newest, other = run / "step-00000004", run / "step-00000002"
        mutate(newest, other)
        _AUDIT["events"].clear()
        _AUDIT["on"] = True
        try:
            with pytest.raises(ck.CheckpointError) as refused:
                ck.load_checkpoint(newest)
            ours, theirs = ck.verify_checkpoint(newest), ckpt_reader.verify(newest)
            latest = ck.find_latest(run, [])
        finally:
            _AUDIT["on"] = False
        assert named in str(refused.value), (what, str(refused.value))
        assert ours and theirs and any(named in p for p in theirs), (what, theirs)
        assert latest == other, what
        for event, args in _AUDIT["events"]:
            if isinstance(args[0], int):
                continue
            path = os.path.abspath(os.fsdecode(args[0]))
            assert path in (str(run), str(newest), str(other)) or path.startswith((str(newest) + os.sep, str(other) + os.sep)), \
                f"{what}: {event} {path}, outside the checkpoint being read"
            if event == "open" and os.path.islink(path):
                assert args[2] & os.O_NOFOLLOW, f"{what}: followed the symbolic link {path}"
        assert not marker.exists(), f"{what}: a payload was executed"
        record(trials=1, bad_inputs=1, faults_survived=1)
        shutil.rmtree(run)
    # the reference reader's CLI: refused (exit 1), the file named, no traceback, never hangs
    for i, (what, named, mutate) in enumerate(cases[:: 1 if reliability_count(1, 0) else 4]):
        ckpt = tmp_path / f"cli-{i}" / "step-00000004"
        shutil.copytree(two_checkpoints / "step-00000004", ckpt)
        mutate(ckpt, two_checkpoints / "step-00000002")
        r = subprocess.run(keel_cmd("ckpt", "verify", str(ckpt)), cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and named in r.stderr and "Traceback" not in r.stderr, (what, r.stderr[-1000:])
        record(bad_inputs=1)
    record.note("hostile inputs", "; ".join(c[0] for c in cases))


# ----------------------------------------------------------------------------- output directories

def _one_line_exit_2(r: subprocess.CompletedProcess, *words: str) -> None:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("keel: ") and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert all(w in lines[0] for w in words), (lines[0], words)


def _unshare_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d && rmdir $d"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


UNSHARE = _unshare_ok()
needs_mounts = pytest.mark.skipif(not UNSHARE, reason="needs unshare --user --mount and tmpfs (a real small "
                                                       "or read-only file system); the injected ENOSPC test still runs")


def _in_mount_ns(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a shell script in a user+mount namespace of its own (it may mount tmpfs: a real small
    or read-only file system, gone when it exits)."""
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-ec", script], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(300)
def test_bad_output_directories_exit_2_before_any_work(tmp_path, record):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    cases = [
        ("--out is a file", ["--out", str(a_file)], [str(a_file), "not a directory"]),
        ("--out below a file", ["--out", str(a_file / "run")], [str(a_file / "run")]),
        ("--resume missing", ["--out", str(tmp_path / "o"), "--resume", str(tmp_path / "nope")], [str(tmp_path / "nope"), "no such directory"]),
        ("--resume a file", ["--out", str(tmp_path / "o2"), "--resume", str(a_file)], [str(a_file), "not a directory"]),
    ]
    for what, args, words in cases:
        r = subprocess.run(keel_cmd("run", str(SCENARIOS / "local-8.toml"), "--no-faults", *args), cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        _one_line_exit_2(r, *words)
        record(trials=1, bad_inputs=1, faults_survived=1)
    assert not (tmp_path / "o" / "events.jsonl").exists() and not (tmp_path / "o2").exists()
    if UNSHARE:  # a read-only file system and a full one, for real
        keel = " ".join(keel_cmd("run", str(SCENARIOS / "local-8.toml"), "--no-faults"))
        for what, prepare, words in [
            ("read-only", "mount -t tmpfs -o ro,size=1m tmpfs $D", ["Read-only file system", "expected a writable directory"]),
            ("full", "mount -t tmpfs -o size=64k tmpfs $D && (dd if=/dev/zero of=$D/fill bs=4k 2>/dev/null || true)",
             ["No space left on device", "expected a writable directory"])]:
            d = tmp_path / f"mnt-{what}"
            d.mkdir()
            r = _in_mount_ns(f"D={d}; {prepare}; exec {keel} --out $D/run")
            _one_line_exit_2(r, f"{d}/run", *words)
            record(trials=1, bad_inputs=1, faults_survived=1)


ENOSPC_CHILD = """
import errno, json, os, sys
from pathlib import Path
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
from runtime import checkpoint as ck
from test_checkpoint import TINY, save, train, CONFIG_HASH, TOPOLOGY
from runtime.model import build_model, build_optimizer
run = Path(sys.argv[1])
model = build_model(TINY, seed=3); opt = build_optimizer(model, TINY)
out = {"saved": [], "error": None}
for step in range(1, 1000):
    train(model, opt, 1, step)
    try:
        save(run, step, model, opt, keep=100)
        out["saved"].append(step)
    except OSError as e:
        out["error"] = [e.errno, str(e)]
        break
out["leftovers"] = sorted(p.name for p in run.iterdir() if not ck.STEP_DIR.match(p.name))
latest = ck.find_latest(run)
out["latest"] = latest.name if latest else None
out["latest_step"] = ck.load_checkpoint(latest).step if latest else None
w = ck.AsyncCheckpointer(run, keep=100)  # the worker's writer: the failure is recorded, not raised
w.snapshot_and_submit(5000, model, opt, ck.capture_rng(), {"step": 5000}, CONFIG_HASH, {}, TOPOLOGY)
w.wait()
out["async_error"] = getattr(w.last_error, "errno", None)
out["after_async"] = ck.find_latest(run).name
print(json.dumps(out))
"""


@needs_mounts
@pytest.mark.timeout(300)
def test_a_full_disk_fails_the_write_cleanly_and_keeps_the_newest_checkpoint(tmp_path, record):
    """A real small tmpfs: checkpoints are written until the file system is full; the failing
    write raises ENOSPC, leaves nothing behind, and the previous checkpoint stays the newest."""
    d = tmp_path / "small"
    d.mkdir()
    child = tmp_path / "enospc_child.py"
    child.write_text(ENOSPC_CHILD)
    r = _in_mount_ns(f"mount -t tmpfs -o size=600k tmpfs {d}; exec {sys.executable} {child} {d}/run")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["saved"], "not even one checkpoint fitted"
    assert out["error"] and out["error"][0] == errno.ENOSPC, out
    assert out["leftovers"] == [], "the failed write left files behind"
    assert out["latest_step"] == out["saved"][-1] and out["latest"] == ck.step_dir_name(out["saved"][-1])
    assert out["async_error"] == errno.ENOSPC and out["after_async"] == out["latest"]
    record(trials=2, faults_survived=2)
    record.note("full disk", f"600 KiB tmpfs: {len(out['saved'])} checkpoints fitted, the next write failed with "
                             f"ENOSPC (sync and async), nothing left behind, step {out['latest_step']} still the newest")


def _tmpfs_bytes(path: Path) -> int:
    """What `path`'s files take on a tmpfs: each rounded up to whole 4 KiB pages."""
    return sum(-(-f.stat().st_size // 4096) * 4096 + 4096 for f in path.rglob("*") if f.is_file())


@needs_mounts
@pytest.mark.timeout(900)
def test_a_full_disk_under_a_real_run_loses_nothing_committed(tmp_path, job_reference, record):
    """`keel run` with its output on a real tmpfs with room for two checkpoints: the later writes
    fail with ENOSPC, the run goes on and says so, and `--resume` from that directory ends
    bit-identical to the uninterrupted run."""
    if not reliability_count(full=1, reduced=0):
        pytest.skip("a FULL-count trial (make reliability): a real run on a small file system")
    ref_out, reference = job_reference.get()
    one_checkpoint = _tmpfs_bytes(step_dirs(ref_out / "checkpoints")[-1])
    size = _tmpfs_bytes(ref_out) - _tmpfs_bytes(ref_out / "checkpoints") + 5 * one_checkpoint // 2 + 65536
    d, res = tmp_path / "small", tmp_path / "res"
    d.mkdir()
    res.mkdir()
    run = " ".join(keel_cmd("run", str(SCENARIOS / "local-8.toml"), *JOB))
    r = _in_mount_ns(f"mount -t tmpfs -o size={size} tmpfs {d}\n"
                     f"{run} --out {d}/run --json > {res}/summary.json 2> {res}/stderr.txt || echo $? > {res}/rc\n"
                     f"ls -a {d}/run/checkpoints > {res}/ls.txt\n"
                     f"{run} --resume {d}/run --out {res}/resumed --json > {res}/resumed.json 2> {res}/resumed.txt\n",
                     timeout=800)
    assert r.returncode == 0 and not (res / "rc").exists(), (r.stderr + (res / "stderr.txt").read_text())[-3000:]
    summary = json.loads((res / "summary.json").read_text())
    failed = [c for c in summary["checkpoints"] if c.get("error")]
    written = [c["step"] for c in summary["checkpoints"] if not c.get("error")]
    assert failed and all("No space left on device" in c["error"] for c in failed), summary["checkpoints"]
    stderr = (res / "stderr.txt").read_text()
    assert f"keel: warning: the checkpoint of step {failed[0]['step']} was not written" in stderr, stderr[-2000:]
    names = (res / "ls.txt").read_text().split()
    assert sorted(n for n in names if n not in (".", "..")) == [ck.step_dir_name(s) for s in written]  # no leftovers
    resumed = json.loads((res / "resumed.json").read_text())
    assert resumed["start_step"] == written[-1]
    assert resumed["final_weights_sha256"] == reference["final_weights_sha256"]
    record(trials=1, faults_survived=len(failed))
    record.note("full disk under keel run", f"tmpfs of {size // 1024} KiB: checkpoints {written} written, "
                                            f"{[c['step'] for c in failed]} failed with ENOSPC, the run went on and "
                                            f"warned; --resume from step {written[-1]} bit-identical")


def test_enospc_injected_at_the_write_layer(two_checkpoints, tmp_path, monkeypatch, record):
    """The same without a file system to fill: ENOSPC at each file and at the directory fsync."""
    model = build_model(TINY, seed=1)
    opt = build_optimizer(model, TINY)
    points = [*ck.FILES, ck.MANIFEST, "fsync-dir"]
    for at in points:
        run = tmp_path / at
        shutil.copytree(two_checkpoints, run)
        real_write, real_fsync = ck.write_synced, ck.fsync_dir

        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a[0]))

        monkeypatch.setattr(ck, "write_synced", lambda p, data: full(p) if p.name == at else real_write(p, data))
        monkeypatch.setattr(ck, "fsync_dir", lambda p: full(p) if at == "fsync-dir" and p.name.startswith(".tmp") else real_fsync(p))
        with pytest.raises(OSError) as e:
            save(run, 6, model, opt)
        monkeypatch.undo()
        assert e.value.errno == errno.ENOSPC
        assert sorted(p.name for p in run.iterdir()) == ["step-00000002", "step-00000004"]
        assert ck.find_latest(run) == run / "step-00000004" and ck.load_checkpoint(run / "step-00000004").step == 4
        record(trials=1, faults_survived=1)
