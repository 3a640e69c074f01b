"""Where twin replicas run for the planner: the twin's own runners (`twin.SerialRunner`, in
this process; `twin.LocalRunner`, local processes, the default), or Ray tasks on a Ray cluster
(`--ray ADDRESS`, optional extra `ray`).

A job is (scenario, seed, calibration); its result is the small part of the twin's summary
the planner scores on, so no event log travels back.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

from keel.errors import InputError
from twin import LocalRunner, SerialRunner

Job = tuple[Any, int, Mapping[str, Any] | None]

SUMMARY_KEYS = ("goodput", "wall_s", "steps", "step_time_s", "restarts")


def twin_summary(job: Job) -> dict[str, Any]:
    """One twin replica: the scoring part of its summary, plus per fault downtime and cost."""
    import twin
    scenario, seed, calibration = job
    summary = twin.simulate(scenario, seed=seed, calibration=calibration).summary
    out = {k: summary.get(k) for k in SUMMARY_KEYS}
    out["seed"] = seed
    out["faults"] = [{k: f.get(k) for k in ("fault_id", "class", "target", "action", "at_step",
                                            "downtime_s", "cost_s", "lost_steps")}
                     for f in summary.get("faults", ())]
    return out


class RayRunner(SerialRunner):
    """Runs jobs as Ray tasks. `address` is a Ray cluster address (`ray://host:10001`,
    `host:6379`), or `auto`, or `local` for a Ray instance started here."""

    def __init__(self, address: str, fn: Callable[[Job], dict] = twin_summary):
        super().__init__(fn)
        try:
            import ray
        except ImportError:
            raise InputError("--ray: Ray is not installed; install keel's optional extra "
                             "(pip install 'keel[ray]')") from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
            if address != "local":
                kwargs["address"] = address
            try:
                ray.init(**kwargs)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise InputError(f"--ray {address}: cannot connect to a Ray cluster there ({e})") from None
            self._started = True
        self._task = ray.remote(fn)

    def imap(self, jobs: Sequence[Job]) -> Iterator[dict]:
        return iter(self._ray.get([self._task.remote(j) for j in jobs]) if jobs else [])

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
            self._started = False


def make_runner(ray_address: str | None = None, processes: int | None = None,
                fn: Callable[[Job], dict] = twin_summary) -> SerialRunner:
    if ray_address:
        return RayRunner(ray_address, fn)
    return LocalRunner(fn, processes)


def seeds_for(base_seed: int, replicas: int) -> list[int]:
    """The common random numbers: every candidate is scored on these same seeds."""
    return [int(base_seed) + i for i in range(replicas)]
