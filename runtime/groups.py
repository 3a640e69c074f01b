"""Process groups for generations: a fresh group per generation (gloo, lazily connected, or
NCCL with a GPU per rank) on a store connection of its own, from a small pool."""
from __future__ import annotations

import datetime
import os
import random
import threading
import time
from typing import Any

PG_TIMEOUT = datetime.timedelta(seconds=120)
WILDCARDS = ("0.0.0.0", "::", "")  # a listening address that names no host to dial


def gloo_device(dist, local_address: str):
    """Where this worker's gloo connections live: the interface GLOO_SOCKET_IFNAME names (as
    torch's own groups do), else the local address of its connection to the coordinator, the
    interface that reaches the job's other hosts (off loopback there is no other default:
    gloo rejects an empty hostname)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname, lazy_init=True)
    return dist.ProcessGroupGloo.create_device(hostname=local_address, lazy_init=True)


class GroupFactory:
    def __init__(self, backend: str, store_host: str, store_port: int, gloo_host: str):
        import torch.distributed as dist
        self.dist = dist
        self.backend = backend
        self.store_host, self.store_port = store_host, store_port
        self.gloo_host = gloo_host
        self._stores: dict[int, Any] = {}
        self._pool_lock = threading.Lock()
        self._pool_rng = random.Random(os.getpid())
        self._store_pool = [self._new_store()]  # the first generation's; a spare follows soon
        self._refill_store_pool()
        self.pgs: list[Any] = []  # this generation's groups, and earlier ones not yet retired

    def make(self, g: int, rank: int, world: int, prefix: str | None = None, retire: bool = False):
        """A fresh process group of generation `g` on `PrefixStore(prefix or 'gen{g}/')`.
        `retire`: the earlier generations' groups are over (every member left them before
        this generation was announced), so they are aborted and dropped (`_reap`)."""
        prefix = prefix or f"gen{g}/"
        dist = self.dist
        if retire and self.pgs:
            old, self.pgs = self.pgs, []
            threading.Thread(target=_reap, args=(old,), daemon=True, name="group-reaper").start()
        if self.backend == "nccl":  # each rank on a GPU of its own
            store = self._store_for(g)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = PG_TIMEOUT
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world, opts)
            self.pgs.append(pg)
            return pg
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [gloo_device(dist, self.gloo_host)]
        opts._timeout = PG_TIMEOUT
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store_for(g)), rank, world, opts)
        self.pgs.append(pg)
        return pg

    def _store_for(self, g: int):
        """Each generation talks to the store over a connection of its own: a lazy connect of
        an aborted group may still sit in a store wait for a dead peer's address, and a TCPStore
        client serialises its operations. Connections come from a small pool, refilled in
        the background at a random moment a few seconds after each use, so 46 workers never
        reconnect at once during a recovery (such a burst stalled the store ~5 s here)."""
        if g in self._stores:
            return self._stores[g]
        with self._pool_lock:
            store = self._store_pool.pop() if self._store_pool else None
        if store is None:
            store = self._new_store()
        self._stores = {g: store}
        self._refill_store_pool()
        return store

    def _refill_store_pool(self) -> None:
        def refill() -> None:
            time.sleep(self._pool_rng.uniform(2.0, 10.0))
            st = self._new_store()
            with self._pool_lock:
                self._store_pool.append(st)
        threading.Thread(target=refill, daemon=True, name="store-refill").start()

    def _new_store(self):
        return self.dist.TCPStore(self.store_host, self.store_port, None, False,
                                  timeout=datetime.timedelta(seconds=300))


def _reap(groups: list[Any]) -> None:
    """Abort and drop old groups, off the training thread. A group left by an abort may still
    have a collective in flight, waiting for a peer that left too (until PG_TIMEOUT); dropping
    it then would block, and keeping it costs a survivor ~3 threads and ~6 descriptors a
    generation (4 Dec). `abort()` fails that work at once (its peers' too: the connections
    close), and the group is then released (30-80 ms here)."""
    while groups:
        pg = groups.pop()
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - a group that cannot abort is still dropped
            pass
        del pg
