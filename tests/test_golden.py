"""The golden curve gate: a seeded short sync job on the demo task (the demo's warm-started model,
its spec, 8 steps) on the session's standing fleet, its held-out reward at steps 0, 2, 4, 6, 8
against the reference committed beside this test (tests/golden/demo_curve.json).

Tolerant where it must be: the reference is the mean curve of 8 seeds measured on one machine, and
each step may be off by max(4 x the seeds' standard deviation there, 0.05), as may the curve's mean
over its trained steps (bench/golden.py `tolerance` says why 4 and 0.05). A run on another machine
(other CPU, thread counts, library builds) is one more draw from that spread; a broken learner is
not: with the policy loss's sign flipped the held-out reward falls instead of rising. The rise is
where the gate is tight (step 2: 0.93 +- 0.11); at lr 1e-4 the demo's policy sometimes falls back
after it (one seed of 8 at 0.42 by step 6), so steps 6 and 8 allow most of the range and the
curve's mean over steps 2-8 (+- 0.44) catches a policy that never learns.

Exact where it can be, as a hint: a seeded job is deterministic on one machine (with
`sampling.seeded` every training group carries its sampling seed, trainer_svc/feeder.py `group_seed`;
the trainer runs one torch thread; held-out rounds are greedy): where this machine is the reference's
(`bench.golden.fingerprint`), a seed-0 curve other than the reference's seed-0 curve is reported as
a warning (not a failure: a near-tie that another batching of the engine flips changes a greedy
token, and CI must not fail on that), so a change in the numbers, intended or not, shows here. An
intended one: regenerate with `python -m bench golden --write` (~2 min).
"""

from __future__ import annotations

import json
import warnings

import pytest
from shared_fleet import Fleet  # tests/ is on sys.path

from bench.golden import REFERENCE, fingerprint, golden_spec, held_out_curve, outside

pytestmark = [pytest.mark.integration]


def test_seeded_demo_job_follows_the_golden_curve(fleet: Fleet, demo_model):
    ref = json.loads(REFERENCE.read_text())
    job_id = fleet.post(golden_spec(demo_model, seed=0))
    job = fleet.wait(job_id, timeout=600)
    assert job["state"] == "finished", (job.get("error"), fleet.sup.tail("trainer"))
    curve = held_out_curve(fleet.ledger, job_id)

    bad = outside(ref, curve)
    assert not bad, f"held-out curve {curve} outside the golden tolerance:\n" + "\n".join(bad)
    if ref["deterministic"] and ref["machine"] == fingerprint():
        expected = {int(s): v for s, v in ref["seed_curves"]["0"].items()}
        if curve != expected:  # a hint, not a gate: one near-tie under another batching flips a greedy token
            warnings.warn(
                f"on the reference machine seed 0 gave {curve}, the reference's seed 0 {expected}; if the "
                "change in the numbers is intended, regenerate: python -m bench golden --write",
                stacklevel=1,
            )
