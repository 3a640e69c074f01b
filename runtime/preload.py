"""Imported once by the fork server that `keel run` forks its workers from: it pays torch's
one-time costs (imports, lazily loaded modules behind the meta device and the first
forward/backward, of a tiny built-in job) so every forked worker starts warm. Single-threaded on purpose: no thread
pool may exist in a process that forks."""
import os

import torch
import torch.distributed  # noqa: F401

torch.set_num_threads(1)

from runtime import checkpoint, data, job_run, worker  # noqa: E402,F401
from runtime.job_gpt import warm_up  # noqa: E402

warm_up()  # the built-in job's first step, through the job API

_job = os.environ.get("KEEL_PRELOAD_JOB")  # "dir|entry": the job's libraries (runtime/coordinator/procs.py)
if _job:
    try:
        job_run.warm_import(_job.partition("|")[2], _job.partition("|")[0] or ".")
    except Exception:  # the worker imports it again and reports what is wrong
        pass
