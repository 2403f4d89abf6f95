"""A real job on a local Redis Cluster (3 primaries + 3 replicas), through a failover.

The job's services (vLLM generator, reward, trainer, broker API) run as processes against
`redis+cluster://`; after the trainer's second step the replica of the primary serving the job's
slot is partitioned (frozen, its link closed), the job writes to the primary alone, the primary is
SIGKILLed and the replica promoted (bench/redis_cluster.py `failover`). The job must go on to
finish; what the promoted replica lacked is measured, and the ledger's verify must find exactly
the samples that loss took for good (the trainer settles a group no stream holds anything of as
`lost`), and nothing else wrong. `python -m bench redis-cluster` runs the same scenario and
writes results/redis_cluster.json.
"""

from __future__ import annotations

import pytest

from bench.redis_cluster import cluster_job

pytestmark = [pytest.mark.redis_cluster, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )


def test_a_job_on_a_cluster_rides_out_its_primary_s_failover(tmp_path, tiny_model):
    res = cluster_job(tmp_path, tiny_model, steps=6, fail_over=True, gap_s=20.0)
    assert res["state"] == "finished" and res["steps"] == 6, res
    fo = res["failover"]
    print(
        f"failover after step {fo['steps_before']}: partitioned {fo['partitioned_s']} s, promoted in "
        f"{fo['promoted_after_s']} s, entries lost {fo['entries_lost']}, XADDs lost {fo['xadds_lost']}, "
        f"samples lost for good {res['failover_samples_lost']}, verify lost {res['verify']['lost']}, "
        f"in flight {res['verify']['in_flight']}"
    )
    assert fo["replica_port"] != fo["primary_port"] and fo["steps_before"] >= 2
    # the partition made the primary alone hold writes, and the failover lost them
    assert sum(fo["xadds_lost"].values()) > 0 and sum(fo["entries_lost"].values()) > 0, fo
    assert all(fo["xadds_lost"][s] >= fo["entries_lost"][s] for s in fo["entries_lost"]), fo
    # verify finds exactly what the failover took for good, and nothing else wrong
    assert res["verify"]["lost"] == res["failover_samples_lost"], res
    assert res["verify"]["ok"] and res["verify"]["violations"] == {}, res["verify"]
    # every lost group's samples have a row: used (redone), lost, or in flight when the job ended
    assert all("absent" not in st for st in fo["lost_group_final_status"].values()), fo
    counts = res["status_counts"]
    assert res["verify"]["in_flight"] == counts.get("generated", 0) + counts.get("scored", 0), (counts, res["verify"])
