"""Partition trials with counts (issue 27), `make reliability` only: seeded real cuts on the
multi-host test bed (tests/partition_trial.py: a region, one way, a host, during a checkpoint,
during a re-formation), each ending with 0 commits by a cut-off minority, 0 steps lost or
repeated, no wait for a commit past its bound, 0 restarts and final weights bit-identical to
the fault-free run. `make test` runs the same machinery once per kind of cut it needs in
tests/test_multihost.py; this runs many, so it is sized for `make reliability`."""
from __future__ import annotations

import random

import pytest

import hostbed
from conftest import RELIABILITY_FULL, reliability_count
from partition_trial import KINDS, clean, trial
from test_multihost import reference  # noqa: F401  (the fault-free run on the same hosts)

pytestmark = [pytest.mark.reliability,
              pytest.mark.skipif(not RELIABILITY_FULL, reason="full counts only (KEEL_RELIABILITY=full): "
                                 "tests/test_multihost.py runs a region cut and the coordinator's in make test"),
              pytest.mark.skipif(bool(hostbed.unavailable()), reason=str(hostbed.unavailable()))]


@pytest.mark.timeout(3600)
def test_seeded_partitions_are_absorbed_safely(reference, tmp_path, record):  # noqa: F811
    rng = random.Random(27)
    rows = []
    for i in range(reliability_count(full=10, reduced=len(KINDS))):
        sub = tmp_path / f"t{i}"
        sub.mkdir()
        row = trial(sub, KINDS[i % len(KINDS)], rng, reference["final_weights_sha256"])
        rows.append(row)
        record(trials=1, faults_survived=len(row["cut"]) if clean(row) else 0,
               losses=row["minority_commits"] + row["lost_or_repeated"])
    record.note("partition trials", "; ".join(
        f"{r['kind']} {'+'.join(r['cut'])} at step {r['at_step'][0]}, heal {r['heal_s']} s: longest wait "
        f"{r['longest_wait_s']} s, minority commits {r['minority_commits']}" for r in rows))
    bad = [r for r in rows if not clean(r)]
    assert not bad, bad
