"""Relay fan-out of weights: which peer each generator fetches a version from.

Without relays every generator pulls every version from the trainer (a star): the trainer's uplink
carries N copies per step. With relays, a generator that has fetched and verified a version serves
it too, and the generators form a tree with fan-out k over their sorted ids (a k-ary heap): the
first id fetches from the trainer, id i from id (i - 1) // k. The trainer then sends one copy per
version and the time until every generator holds it grows with the tree's depth, log_k N, instead
of with N. A relay passes on a chunk only once it matched the trainer's manifest
(`shared.transport.base.Streaming`), so it can never hand on bytes it did not verify (and its
children verify again against that same manifest, which came from the trainer on the policy
stream, not from the relay).

Everything here is pure (no I/O); generator_svc/relay.py runs it against Redis and a transport.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

TRAINER = ""
"""The source name of the trainer itself (no generator id is empty)."""


def tree_ancestors(members: Collection[str], me: str, fanout: int) -> list[str]:
    """The ids `me` may fetch from in the tree, nearest first (parent, grandparent, ... root);
    empty when `me` is the root or `fanout` is 0 (the star: fetch from the trainer).

    `members` are the generators known to take part (`me` is counted in whether listed or not);
    their sorted order is the heap order, so a parent's id always sorts before its child's: two
    generators that see different member sets may pick different parents, but never wait on each
    other in a cycle.

    Raises:
        ValueError: a negative fan-out.
    """
    if fanout < 0:
        raise ValueError(f"relay fan-out must be >= 0 (0: every generator fetches from the trainer), got {fanout}")
    if fanout == 0:
        return []
    order = sorted(set(members) | {me})
    i = order.index(me)
    out = []
    while i > 0:
        i = (i - 1) // fanout
        out.append(order[i])
    return out


def tree_depth(n: int, fanout: int) -> int:
    """Hops from the trainer to the deepest of `n` generators: 1 for the star, 1 + the heap's
    height for the tree (the last heap index is the deepest)."""
    if n <= 0:
        return 0
    if fanout == 0:
        return 1
    i, depth = n - 1, 1
    while i > 0:
        i, depth = (i - 1) // fanout, depth + 1
    return depth


SERVING, COMING = "serving", "coming"


def pick_source(
    ancestors: list[str],
    state: Mapping[str, str],
    tried: Collection[str],
    *,
    wait_idle: bool,
    wait_coming: bool,
) -> str | None:
    """Where to fetch a version from now: the nearest ancestor that serves it, the trainer
    (`TRAINER`), or None (wait and ask again).

    ancestors: nearest first, live ones only (a dead relay has dropped out of the member list).
    state: per ancestor, `SERVING` (it holds the version, verified), `COMING` (it is fetching it)
        or anything else (idle: it has not started on it, or it moved on to a newer one).
    tried: sources that failed this version (refused, hung up, bytes that did not verify).
    wait_idle: still within the short grace for an idle ancestor (it may not have read the
        announcement yet).
    wait_coming: still within the long wait for an ancestor that is fetching.

    Walking up from the parent, skipping the tried ones: the first that serves is the source; one
    still worth waiting for means wait; past them all, the trainer.
    """
    for a in ancestors:
        if a in tried:
            continue
        s = state.get(a, "")
        if s == SERVING:
            return a
        if wait_coming if s == COMING else wait_idle:
            return None
    return TRAINER
