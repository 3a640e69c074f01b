"""The emulated cluster's hierarchical all-reduce (runtime/emulation/hier.py): the plan against a
plain sum, its clocks, and the real messages on a real gloo group."""
from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch

from runtime.emulation.hier import build_plan, clocks, run_plan, simulate

pytestmark = pytest.mark.timeout(120)


def _layout(rng: random.Random, world: int) -> list[list[int]]:
    ranks = list(range(world))
    rng.shuffle(ranks)
    cuts = sorted(rng.sample(range(1, world), rng.randint(0, min(4, world - 1)))) if world > 1 else []
    return [ranks[a:b] for a, b in zip([0] + cuts, cuts + [world])]


@pytest.mark.parametrize("op", ["sum", "max"])
def test_plan_equals_a_plain_all_reduce(op):
    rng = random.Random(11)
    for trial in range(150):
        world = rng.randint(1, 9)
        length = rng.choice([0, 1, 2, 3, 5, 7, 16, 33, 100])
        regions = _layout(rng, world)
        g = torch.Generator().manual_seed(trial)
        if op == "sum":
            vecs = [torch.randint(-2 ** 40, 2 ** 40, (length,), generator=g, dtype=torch.int64) for _ in range(world)]
            want = sum(vecs) if vecs else None
        else:
            vecs = [torch.randn(length, generator=g) for _ in range(world)]
            want = torch.stack(vecs).max(dim=0).values
        for exchange in (False, True) if trial % 3 == 0 else (False,):  # or one exchange (the exponents')
            got = simulate(build_plan(regions, length, exchange), vecs, op)
            for r in range(world):
                assert torch.equal(got[r], want), (regions, length, r, exchange)


def test_plan_shape():
    plan = build_plan([[0, 1, 2], [3, 4]], 12)
    assert [s.phase for s in plan] == ["intra-reduce"] * 2 + ["inter-reduce", "inter-gather"] + ["intra-gather"] * 2
    exchange = build_plan([[0, 1, 2], [3, 4], [5]], 12, exchange=True)
    assert [s.phase for s in exchange] == ["intra-reduce"] * 2 + ["inter-exchange"] + ["intra-gather"] * 2
    # the first step: ring inside each region at once (region b has 2 members: one step only)
    assert {(m.src, m.dst) for m in plan[0].msgs} == {(0, 1), (1, 2), (2, 0), (3, 4), (4, 3)}
    assert {(m.src, m.dst) for m in plan[1].msgs} == {(0, 1), (1, 2), (2, 0)}
    # across regions only owners talk, and only the pieces of the global partition
    inter = [m for s in plan if s.phase.startswith("inter") for m in s.msgs]
    assert all((m.src < 3) != (m.dst < 3) for m in inter)
    assert sum(m.length for m in plan[2].msgs) == 12 and sum(m.length for m in plan[3].msgs) == 12
    assert build_plan([[4]], 10) == () and build_plan([[0, 1]], 0) == ()


def test_clocks_by_hand():
    plan = build_plan([[0, 1], [2]], 4)
    # every message takes 1 s plus 0.1 s per element
    c = clocks(plan, [0.0, 5.0, 0.0], lambda step, m, t: t + 1.0 + 0.1 * m.length)
    # step 0: 0<->1 exchange 2-element chunks: rank 1 gets 0+1.2, rank 0 gets 5+1.2
    # inter: owners 0 (chunk [2,4)) and 1 (chunk [0,2)) with rank 2 ([0,4)) over G_0=[0,2), G_1=[2,4)
    assert len(plan) == 4
    # hand account: after step 0 c = [6.2, 5.0, 0.0] (rank 1 keeps 5.0 > 1.2)
    # reduce step (a sends G_0 = [0,2): owner 1 -> 2; b sends G_1: 2 -> owner 0):
    #   c2 = max(0, 5 + 1.2) = 6.2; c0 = max(6.2, 0 + 1.2) = 6.2
    # gather step (a sends G_1: owner 0 -> 2; b sends G_0: 2 -> owner 1):
    #   c2 = max(6.2, 6.2 + 1.2) = 7.4; c1 = max(5, 6.2 + 1.2) = 7.4
    # intra gather: 0 sends chunk 1 to 1, 1 sends chunk 0 to 0: c1 = max(7.4, 7.4), c0 = max(6.2, 8.6)
    assert c == pytest.approx([8.6, 7.4, 7.4])


def _worker(rank, world, port, regions, length, op, abort_at, q):
    import torch.distributed as dist
    from runtime.waiting import Aborted
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, world, opts)
        g = torch.Generator().manual_seed(rank)
        buf = (torch.randint(-2 ** 50, 2 ** 50, (length,), generator=g, dtype=torch.int64) if op == "sum"
               else torch.randn(length, generator=g))
        plan = build_plan(regions, length)
        deadline = time.monotonic() + 1.0
        if abort_at is not None and rank == abort_at:
            q.put((rank, "absent", None, None))  # never joins: the others must leave on abort
            time.sleep(3)
            return
        should_abort = (lambda: time.monotonic() > deadline) if abort_at is not None else (lambda: False)
        try:
            c = run_plan(pg, rank, plan, buf, op, float(rank), lambda s, m, t: t + 0.5 + m.length * 1e-3, should_abort)
        except Aborted:
            q.put((rank, "aborted", None, None))
            return
        q.put((rank, "ok", buf.numpy().tobytes(), c))
    except Exception as e:  # pragma: no cover - reported to the test
        q.put((rank, "error", repr(e), None))


def _run_group(regions, length, op, abort_at=None):
    import socket
    world = sum(len(r) for r in regions)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, regions, length, op, abort_at, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(world):
            rank, status, data, c = q.get(timeout=90)
            out[rank] = (status, data, c)
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("op", ["sum", "max"])
def test_real_gloo_group_matches_the_reference(op):
    regions = [[0, 3, 5], [1, 4], [2]]
    length = 1001
    out = _run_group(regions, length, op)
    vecs = []
    for rank in range(6):
        g = torch.Generator().manual_seed(rank)
        vecs.append(torch.randint(-2 ** 50, 2 ** 50, (length,), generator=g, dtype=torch.int64) if op == "sum"
                    else torch.randn(length, generator=g))
    want = simulate(build_plan(regions, length), vecs, op)
    expect_clocks = clocks(build_plan(regions, length), [float(r) for r in range(6)],
                           lambda s, m, t: t + 0.5 + m.length * 1e-3)
    for rank in range(6):
        status, data, c = out[rank]
        assert status == "ok", out[rank]
        assert data == want[rank].numpy().tobytes()
        assert c == expect_clocks[rank]


def test_abort_releases_a_rank_waiting_on_an_absent_peer():
    out = _run_group([[0, 1], [2]], 64, "sum", abort_at=2)
    assert out[2][0] == "absent"
    assert out[0][0] == "aborted" and out[1][0] == "aborted"


def test_connecting_to_a_member_that_never_formed_the_group_leaves_at_the_abort(monkeypatch):
    """gloo connects a pair lazily, and the connect waits in the store for the peer's address on
    the thread that posts the first message, up to the group's timeout (120 s). A member that saw
    a generation's abort before its announcement never forms that group and publishes none: the
    reduction's pairs, connected as the generation forms (EmulatedComms.connect), must leave at
    the abort all the same. Posted on the training thread, they did not, and the members still
    forming the group were lost for not leaving it (sweep member 3/8, 7 Dec)."""
    import datetime
    import socket
    import threading
    from pathlib import Path

    import torch.distributed as dist

    from keel.scenario import load
    from runtime.emulation.worker import EmulatedComms
    from runtime.groups import GroupFactory
    from runtime.reduction import Layout, SlotReducer, reduction_format
    from runtime.waiting import Aborted, Waiter
    sc = load(Path(__file__).resolve().parents[1] / "scenarios" / "multiregion-12.toml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60))
    import runtime.groups
    monkeypatch.setattr(runtime.groups, "PG_TIMEOUT", datetime.timedelta(seconds=3))  # so the connect left behind ends soon
    pg = GroupFactory("gloo", "127.0.0.1", port, "127.0.0.1").make(0, 0, 2)  # lazily connected, as a worker's
    waiter = Waiter()
    comms = EmulatedComms(sc, None, waiter)
    comms.reducer = SlotReducer(Layout((10, 1)), sc.slot_count, "cpu", waiter, collective=comms.collective,
                                fmt=reduction_format(sc))
    members = [f"{sc.regions[0].name}/0", f"{sc.regions[1].name}/0"]  # rank 1 never forms its group
    comms.generation(0, 0, members)
    t0 = time.monotonic()
    with pytest.raises(Aborted):
        comms.connect(pg, lambda: time.monotonic() > t0 + 0.5)
    assert time.monotonic() - t0 < 10, "sat out the store's wait for the absent member's address"
    for t in [t for t in threading.enumerate() if t.name == "pair-connect"]:  # the connect left behind ends
        t.join(60)                                                              # with the group's own timeout
        assert not t.is_alive()
    del server
