"""Placement of one node's services on its cores (shared.placement): the plan from hand-made core lists, and a
service placing itself."""

from __future__ import annotations

import pytest

from shared.placement import (
    Placement,
    cpuset,
    node_services,
    parse_cpuset,
    place_self,
    plan_placement,
)

ONE_BOX = [("generator-0", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc")]


def test_cpuset_round_trip():
    assert parse_cpuset("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpuset([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    for bad in ("a-b", "3-1", "1-x"):
        with pytest.raises(ValueError):
            parse_cpuset(bad)


def test_two_cores_are_split_as_the_bench_pins_them():
    # the bench's hand placement: the generator's OpenMP on the first core, the trainer's single
    # torch thread on the last, the reward floating with one worker
    p = plan_placement(ONE_BOX, [0, 1], {})
    assert p["generator-0"] == Placement(frozenset({0}), {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert p["trainer"] == Placement(frozenset({1}), {"TRAINER_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert p["reward"].cpus is None and p["reward"].env["REWARD_WORKERS"] == "1"


def test_sixteen_cores_two_generators_and_the_reward_share():
    names = [
        ("broker", "broker"),
        ("generator-0", "generator_svc"),
        ("generator-1", "generator_svc"),
        ("reward", "reward_svc"),
        ("trainer", "trainer_svc"),
    ]
    p = plan_placement(names, list(range(16)), {})
    assert p["broker"] == Placement(None)
    assert p["reward"].cpus == frozenset({14, 15}) and p["reward"].env["REWARD_WORKERS"] == "2"
    # 14 left: 7 for the generators (4 + 3, disjoint), 7 for the trainer
    assert p["generator-0"].cpus == frozenset(range(4)) and p["generator-1"].cpus == frozenset(range(4, 7))
    assert p["generator-1"].env["VLLM_CPU_OMP_THREADS_BIND"] == "4-6"
    assert p["trainer"].cpus == frozenset(range(7, 14)) and p["trainer"].env["TRAINER_THREADS"] == "7"
    taken = [c for n in ("generator-0", "generator-1", "reward", "trainer") for c in p[n].cpus]
    assert len(taken) == len(set(taken)) == 16


def test_overrides_and_a_node_with_only_some_roles():
    env = {"TRAINER_CPUS": "6-7", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    p = plan_placement(ONE_BOX, list(range(8)), env)
    assert p["trainer"].cpus == frozenset({6, 7})
    assert p["generator-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # the user's setting wins
    with pytest.raises(ValueError, match="not available"):
        plan_placement(ONE_BOX, [0, 1], {"GEN_CPUS": "4-5"})
    # a generator-only node: its generators take every core
    gens = plan_placement([("generator-0", "generator_svc"), ("generator-1", "generator_svc")], list(range(4)), {})
    assert gens["generator-0"].cpus == frozenset({0, 1}) and gens["generator-1"].cpus == frozenset({2, 3})


def test_gpus_one_per_generator_the_rest_to_the_trainer():
    names = [("generator-0", "generator_svc"), ("generator-1", "generator_svc"), ("trainer", "trainer_svc")]
    p = plan_placement(names, list(range(8)), {}, gpus=4)
    assert [p[n].env["CUDA_VISIBLE_DEVICES"] for n in ("generator-0", "generator-1", "trainer")] == ["0", "1", "2,3"]
    shared = plan_placement(names, list(range(8)), {}, gpus=1)
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in shared.values()} == {"0"}  # co-located on one device
    assert (
        "CUDA_VISIBLE_DEVICES"
        not in plan_placement(names, list(range(8)), {"CUDA_VISIBLE_DEVICES": "3"}, gpus=4)["trainer"].env
    )


def test_one_core_every_role_shares_it():
    p = plan_placement(ONE_BOX, [0], {})
    assert p["generator-0"].cpus == p["trainer"].cpus == frozenset({0})
    assert p["generator-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and p["trainer"].env["TRAINER_THREADS"] == "1"
    assert p["reward"].cpus is None


def test_four_cores_reward_gets_one():
    p = plan_placement(ONE_BOX, [0, 1, 2, 3], {})
    assert p["reward"].cpus == frozenset({3}) and p["reward"].env["REWARD_WORKERS"] == "1"
    assert p["generator-0"].cpus == frozenset({0, 1}) and p["trainer"].cpus == frozenset({2})


def test_colocated_gives_generator_and_trainer_every_core():
    for cores, gen_bind in (([0, 1], "0-1"), ([0], "0")):
        p = plan_placement(ONE_BOX, cores, {}, mode="colocated")
        assert p["generator-0"].cpus == p["trainer"].cpus == frozenset(cores)
        assert p["generator-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == gen_bind
        assert p["trainer"].env["TRAINER_THREADS"] == p["trainer"].env["OMP_NUM_THREADS"] == str(len(cores))
    p = plan_placement(ONE_BOX, list(range(16)), {}, mode="colocated")
    assert p["reward"].cpus == frozenset({14, 15})  # the reward keeps its own share
    assert p["generator-0"].cpus == p["trainer"].cpus == frozenset(range(14))
    assert p["trainer"].env["TRAINER_THREADS"] == "14"
    # GPUs: shared by both, even with one per role available
    g = plan_placement(ONE_BOX, list(range(8)), {}, gpus=4, mode="colocated")
    assert g["generator-0"].env["CUDA_VISIBLE_DEVICES"] == g["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    with pytest.raises(ValueError, match="valid are split, colocated"):
        plan_placement(ONE_BOX, [0, 1], {}, mode="shared")


def test_node_services_and_a_replica_without_an_index():
    assert node_services(["trainer", "generator", "reward"], 2, replica=1) == [
        ("generator-0", "generator_svc"),
        ("generator-1", "generator_svc"),
        ("reward", "reward_svc"),
        ("trainer", "trainer_svc"),
    ]
    # no index: planned as one generator, so the replica shares the generators' whole slice
    assert node_services(["generator", "trainer"], 3) == [("generator-0", "generator_svc"), ("trainer", "trainer_svc")]


def _place(module, env, cores, gpus=0):
    """place_self on a copy of `env`, with the affinity call captured instead of applied."""
    import os

    pinned = []
    real = os.sched_setaffinity
    os.sched_setaffinity = lambda pid, cpus: pinned.append(set(cpus))  # type: ignore[assignment]
    try:
        environ = dict(env)
        p = place_self(module, environ, cores=cores, gpus=gpus)
    finally:
        os.sched_setaffinity = real
    return p, environ, pinned


def test_a_service_places_itself_as_the_launcher_would():
    node = {"NODE_ROLES": "generator,reward,trainer", "NODE_GENERATORS": "2"}
    names = [
        ("generator-0", "generator_svc"),
        ("generator-1", "generator_svc"),
        ("reward", "reward_svc"),
        ("trainer", "trainer_svc"),
    ]
    launcher = plan_placement(names, list(range(16)), {})
    for module, extra, name in (
        ("generator_svc", {"GEN_REPLICA": "1"}, "generator-1"),
        ("trainer_svc", {}, "trainer"),
        ("reward_svc", {}, "reward"),
    ):
        p, environ, pinned = _place(module, {**node, **extra}, list(range(16)))
        assert p == launcher[name], module
        assert pinned == [set(launcher[name].cpus)]
        assert all(environ[k] == v for k, v in launcher[name].env.items())
    # a trainer-only node: every core it may use, as many torch threads
    p, environ, _ = _place("trainer_svc", {"NODE_ROLES": "trainer"}, [2, 3])
    assert p is not None and p.cpus == frozenset({2, 3}) and environ["TRAINER_THREADS"] == "2"
    # no NODE_ROLES: nothing is known of the node, the process keeps what it was started with
    assert _place("trainer_svc", {}, [0, 1]) == (None, {}, [])
    # a thread variable the user set wins; NODE_PLACEMENT=off (the launcher placed it) places nothing
    _, environ, _ = _place("trainer_svc", {**node, "TRAINER_THREADS": "5"}, [0, 1])
    assert environ["TRAINER_THREADS"] == "5"
    assert _place("trainer_svc", {**node, "NODE_PLACEMENT": "off"}, [0, 1]) == (
        None,
        {**node, "NODE_PLACEMENT": "off"},
        [],
    )
    assert _place("broker", node, [0, 1])[0] is None
    # co-located by the node's declaration
    p, environ, _ = _place(
        "generator_svc", {**node, "NODE_PLACEMENT": "colocated", "GEN_REPLICA": "0", "NODE_GENERATORS": "1"}, [0, 1]
    )
    assert p is not None and p.cpus == frozenset({0, 1}) and environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_bad_placement_variables_are_clear_errors():
    for env, match in (
        ({"NODE_ROLES": "generator,trainr"}, "unknown role"),
        ({"NODE_PLACEMENT": "both"}, "NODE_PLACEMENT|placement"),
        ({"NODE_ROLES": "generator", "NODE_GENERATORS": "2", "GEN_REPLICA": "2"}, "replicas count from 0"),
        ({"NODE_ROLES": "trainer", "TRAINER_CPUS": "7"}, "not available"),
    ):
        with pytest.raises(ValueError, match=match):
            _place("generator_svc" if "GEN_REPLICA" in env else "trainer_svc", env, [0, 1])
