"""`keel data prepare [--out DIR] [--shards N] [--json]`: build (or verify) the built-in job's versioned dataset."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from keel.errors import InputError
from keel.rundir import print_json


def data_prepare(args: argparse.Namespace) -> int:
    from runtime.data import default_root
    from runtime.job_gpt import prepare_dataset

    if args.shards < 1:
        raise InputError(f"--shards: expected a positive number of shards, got {args.shards}")
    root = Path(args.out) if args.out else default_root(args.shards)
    ds = prepare_dataset(root, args.shards, progress=True)
    summary = {"root": str(ds.root), "version": ds.version, "shards": ds.shards, "shard_bytes": ds.shard_bytes,
               "bytes": ds.shards * ds.shard_bytes, "built": ds.built, "source": ds.index["source"]}
    if args.json:
        print_json(summary)
    else:
        what = "built" if ds.built else "verified"
        print(f"{what} dataset {ds.version} at {ds.root}: {ds.shards} shards of {ds.shard_bytes} bytes "
              f"({ds.index['source']['files']} stdlib files)", file=sys.stderr if args.json else sys.stdout)
    return 0
