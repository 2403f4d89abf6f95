"""A real job on a local Redis Cluster (3 primaries + 3 replicas), through a failover.

The job's services (vLLM generator, reward, trainer, broker API) run as processes against
`redis+cluster://`; after the trainer's second step the primary serving the job's slot is
SIGKILLed (its replica's link cut over the second before, so replication has something to lose) and the
replica promoted. The job must go on to finish; what the promoted replica lacked is measured
(bench/redis_cluster.py `failover`), and each lost item must end where the design says: a lost
prompt group never reaches the ledger, a lost rollout or scored entry is redone and used. verify
must find no violation. `python -m bench redis-cluster` runs the same scenario and writes
results/redis_cluster.json.
"""

from __future__ import annotations

import pytest

from bench.redis_cluster import cluster_job
from broker.ledger import USED_STATUSES

pytestmark = [pytest.mark.redis_cluster, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from trainer_svc.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128,
                            seed=0)


def test_a_job_on_a_cluster_rides_out_its_primary_s_failover(tmp_path, tiny_model):
    res = cluster_job(tmp_path, tiny_model, steps=6, fail_over=True, gap_s=20.0)
    assert res["state"] == "finished" and res["steps"] == 6, res
    fo = res["failover"]
    print(f"failover after step {fo['steps_before']}: promoted in {fo['promoted_after_s']} s, "
          f"{fo['replication_bytes_behind']} replication bytes behind, entries lost {fo['entries_lost']}, "
          f"samples lost for good {res['failover_samples_lost']}, verify in flight {res['verify']['in_flight']}")
    assert fo["replica_port"] != fo["primary_port"] and fo["steps_before"] >= 2
    # the two measures of the loss agree, stream by stream
    assert fo["entries_lost"] == fo["entries_lost_by_entries_added"], fo
    # a lost prompt group never reached the ledger; a lost rollout or scored sample was redone
    assert fo["lost_prompt_groups_never_generated"] == fo["lost_prompt_groups"], fo
    assert all(s in (*USED_STATUSES, "generated", "scored") and s != "absent"
               for s in fo["lost_samples_final_status"].values()), fo
    assert res["failover_samples_lost"] == 4 * len(fo["lost_prompt_groups"]) + sum(
        1 for s in fo["lost_samples_final_status"].values() if s not in USED_STATUSES)
    assert res["verify"]["violations"] == {}, res["verify"]
    # every sample the ledger holds is trained, or in flight as verify reports it
    counts = res["status_counts"]
    assert res["verify"]["ok"], res["verify"]
    assert res["verify"]["in_flight"] == counts.get("generated", 0) + counts.get("scored", 0), (counts, res["verify"])
