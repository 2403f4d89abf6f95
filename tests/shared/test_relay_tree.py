"""The relay tree and the source rule (shared/transport/relay.py), against hand-drawn trees."""

from __future__ import annotations

import time

import pytest

from shared.transport.base import Uplink
from shared.transport.relay import COMING, SERVING, TRAINER, pick_source, tree_ancestors, tree_depth

IDS = [f"g{i}" for i in range(7)]


def test_binary_tree_by_hand():
    # fan-out 2 over g0..g6 (sorted ids = heap order):
    #            g0            <- fetches from the trainer
    #        g1      g2
    #      g3  g4  g5  g6
    assert tree_ancestors(IDS, "g0", 2) == []
    assert tree_ancestors(IDS, "g1", 2) == ["g0"]
    assert tree_ancestors(IDS, "g2", 2) == ["g0"]
    assert tree_ancestors(IDS, "g4", 2) == ["g1", "g0"]
    assert tree_ancestors(IDS, "g5", 2) == ["g2", "g0"]
    assert tree_ancestors(IDS, "g6", 2) == ["g2", "g0"]


def test_fanout_three_and_one():
    # fan-out 3: g0 -> g1 g2 g3; g1 -> g4 g5 g6
    assert [tree_ancestors(IDS, g, 3) for g in IDS] == [[], ["g0"], ["g0"], ["g0"], ["g1", "g0"], ["g1", "g0"],
                                                         ["g1", "g0"]]
    # fan-out 1: a chain
    assert tree_ancestors(IDS[:4], "g3", 1) == ["g2", "g1", "g0"]


def test_star_and_membership():
    assert all(tree_ancestors(IDS, g, 0) == [] for g in IDS)  # star: everyone from the trainer
    # `me` counts whether listed or not; order is by id, not by listing order
    assert tree_ancestors(["g2", "g0"], "g1", 2) == ["g0"]
    assert tree_ancestors(["b", "c"], "a", 2) == []  # the smallest id is the root
    # a parent always sorts before its child: no cycles whatever two relays believe
    for me in IDS:
        assert all(a < me for a in tree_ancestors(IDS, me, 2))
    with pytest.raises(ValueError, match="fan-out must be >= 0"):
        tree_ancestors(IDS, "g0", -1)


def test_tree_depth():
    # hops trainer -> deepest: star 1; binary tree of 1, 2, 3, 4, 7, 8, 16 nodes
    assert tree_depth(16, 0) == 1
    assert [tree_depth(n, 2) for n in (1, 2, 3, 4, 7, 8, 16)] == [1, 2, 2, 3, 3, 4, 5]
    assert tree_depth(0, 2) == 0


def test_pick_source_rules():
    anc = ["p", "gp", "root"]
    both = {"wait_idle": True, "wait_coming": True}
    # the parent serves: take it
    assert pick_source(anc, {"p": SERVING, "root": SERVING}, set(), **both) == "p"
    # the parent is coming: wait, even though the root serves
    assert pick_source(anc, {"p": COMING, "root": SERVING}, set(), **both) is None
    # the parent is idle: wait during the grace, then go up to the nearest that serves
    assert pick_source(anc, {"gp": SERVING}, set(), **both) is None
    assert pick_source(anc, {"gp": SERVING}, set(), wait_idle=False, wait_coming=True) == "gp"
    # idle parent, grandparent coming: wait for the grandparent past the grace
    assert pick_source(anc, {"gp": COMING}, set(), wait_idle=False, wait_coming=True) is None
    # the parent failed (tried): skip it
    assert pick_source(anc, {"p": SERVING, "gp": SERVING}, {"p"}, **both) == "gp"
    # nothing serves and nobody is worth waiting for: the trainer
    assert pick_source(anc, {"p": COMING}, set(), wait_idle=False, wait_coming=False) == TRAINER
    assert pick_source([], {}, set(), **both) == TRAINER  # the root


def test_uplink_rate():
    # 5 x 1 MB at 20 MB/s: 0.05 s each, less the first MB of burst credit = 0.2 s
    link = Uplink(20e6)
    t0 = time.monotonic()
    for _ in range(5):
        link.take(1_000_000)
    assert time.monotonic() - t0 >= 0.19  # a lower bound only: the sleep can overshoot on a busy box
    with pytest.raises(ValueError):
        Uplink(0)
