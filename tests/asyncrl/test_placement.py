"""Placement of one node's services on its cores (asyncrl.placement), and its use by the launcher."""

from __future__ import annotations

import pytest

from asyncrl.placement import Placement, cpuset, parse_cpuset, plan_placement

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
    names = [("broker", "broker"), ("generator-0", "generator_svc"), ("generator-1", "generator_svc"),
             ("reward", "reward_svc"), ("trainer", "trainer_svc")]
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
    assert "CUDA_VISIBLE_DEVICES" not in plan_placement(names, list(range(8)), {"CUDA_VISIBLE_DEVICES": "3"},
                                                        gpus=4)["trainer"].env
