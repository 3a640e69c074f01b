"""Where twin replicas run: in this process or in a pool of local processes. One runner for
`twin.simulate_replicas` and the planner's scoring (which adds a Ray runner of its own)."""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator, Sequence

Job = Any  # a picklable argument of the runner's function


class SerialRunner:
    """Runs every job in this process."""

    def __init__(self, fn: Callable[[Job], Any]):
        self.fn = fn

    def imap(self, jobs: Sequence[Job]) -> Iterator[Any]:
        """The results in the jobs' order, each as soon as it and those before it are done."""
        return (self.fn(j) for j in jobs)

    def map(self, jobs: Sequence[Job]) -> list[Any]:
        return list(self.imap(jobs))

    def close(self) -> None:
        pass

    def __enter__(self) -> "SerialRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalRunner(SerialRunner):
    """Runs jobs in a pool of local processes (one per core unless told otherwise), kept for
    the runner's life so repeated maps do not pay for new processes."""

    def __init__(self, fn: Callable[[Job], Any], processes: int | None = None):
        super().__init__(fn)
        self.processes = processes or os.cpu_count() or 1
        self._pool: ProcessPoolExecutor | None = None

    def imap(self, jobs: Sequence[Job]) -> Iterator[Any]:
        if self.processes <= 1 or len(jobs) <= 1:
            return super().imap(jobs)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.processes)
        return self._pool.map(self.fn, jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
