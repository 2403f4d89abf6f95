"""The relay tree and the source rule (shared/transport/relay.py) against hand-drawn trees; the
emulated uplink; a version served while it still arrives, only as far as it verified."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from shared.transport import TcpWeightClient, TcpWeightServer, build_manifest
from shared.transport.base import Streaming, Uplink
from shared.transport.relay import COMING, SERVING, TRAINER, pick_source, tree_ancestors, tree_depth
from shared.transport.wire import recv_msg, send_msg, split_address

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
    assert [tree_ancestors(IDS, g, 3) for g in IDS] == [
        [],
        ["g0"],
        ["g0"],
        ["g0"],
        ["g1", "g0"],
        ["g1", "g0"],
        ["g1", "g0"],
    ]
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


def _recv_some(sock, want: int, timeout_s: float) -> int:
    """Bytes that arrive on `sock` within `timeout_s`, up to `want`."""
    sock.settimeout(timeout_s)
    got = 0
    try:
        while got < want:
            n = len(sock.recv(min(1 << 20, want - got)))
            if n == 0:
                break
            got += n
    except TimeoutError:
        pass
    return got


def test_a_streaming_version_is_served_only_as_far_as_it_verified():
    """A relay passes a version on while it arrives (`Streaming`): the server sends a byte only
    once every chunk up to it has verified, in order; an aborted fetch cuts the reader off."""
    mib = 1 << 20
    buf = np.random.default_rng(3).integers(0, 256, 3 * mib, dtype=np.uint8)
    m = build_manifest(1, [("w", [buf.nbytes], "uint8", buf.nbytes)], buf, chunk_bytes=mib)
    srv = TcpWeightServer()
    st = Streaming(m)
    st.buf[:] = buf  # every byte has landed, none verified yet
    srv.serve(m, st)  # type: ignore[arg-type]
    try:
        with socket.create_connection(split_address(srv.address)) as sock:
            send_msg(sock, {"version": 1, "offset": 0, "length": buf.nbytes})
            assert recv_msg(sock) == {"ok": True, "nbytes": buf.nbytes}
            st.mark(1)  # chunk 1 verified but not chunk 0: nothing may go
            assert _recv_some(sock, buf.nbytes, 0.3) == 0
            st.mark(0)  # chunks 0 and 1 now: exactly 2 MiB go
            assert _recv_some(sock, buf.nbytes, 0.5) == 2 * mib
            st.abort()  # chunk 2 never verifies: the connection ends without it
            assert _recv_some(sock, buf.nbytes, 2.0) == 0
        # a whole, verified version from a streaming one
        st2 = Streaming(m)
        st2.buf[:] = buf
        srv.serve(m, st2)  # type: ignore[arg-type]
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(buf=TcpWeightClient().fetch(srv.address, m)))
        t.start()
        for i in (2, 0, 1):
            time.sleep(0.05)
            st2.mark(i)
        t.join(10)
        assert np.array_equal(got["buf"], buf)
    finally:
        srv.close()
