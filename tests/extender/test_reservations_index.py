"""A pod's reservations are found through an index by uid (extender.state.reservations), not a scan of every
reservation: the index must say exactly what a scan says after any sequence of the store's operations, including
those that end reservations in bulk (settle, expire, remap)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extender.state.reservations import POD, Reservations

UIDS = ("u0", "u1", "u2", "u3")
NODES = ("n0", "n1", "n2")
GPUS = ("g0", "g1", "g2")

op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(UIDS), st.sampled_from(NODES),
              st.sets(st.sampled_from(GPUS), min_size=1)),
    st.tuples(st.just("release"), st.sampled_from(UIDS), st.one_of(st.none(), st.sampled_from(NODES))),
    st.tuples(st.just("release_if"), st.sampled_from(UIDS), st.sampled_from(NODES)),
    st.tuples(st.just("settle"), st.sampled_from(NODES), st.sets(st.sampled_from(GPUS))),
    st.tuples(st.just("expire"), st.sampled_from(UIDS)),
    st.tuples(st.just("remap"), st.sampled_from(NODES), st.sets(st.sampled_from(GPUS))),
    st.tuples(st.just("tick"), st.integers(0, 3)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_a_pods_reservations_are_what_a_scan_of_all_of_them_finds(ops: list[tuple]) -> None:
    now = [0.0]
    store = Reservations(timeout_s=2.0, clock=lambda: now[0])
    for o in ops:
        kind = o[0]
        if kind == "add":
            _, uid, node, ids = o
            store.add(uid, "default", uid, node, ids, 0, POD)
        elif kind == "release":
            _, uid, node = o
            expected = [r for r in store.all() if r.uid == uid and (node is None or r.node == node)]
            assert sorted(store.release(uid, node), key=lambda r: r.node) == sorted(expected, key=lambda r: r.node)
        elif kind == "release_if":
            _, uid, node = o
            current = store.get(uid, node)
            if current is not None:
                assert store.release_if(uid, node, current)
        elif kind == "settle":
            _, node, used = o
            store.settle(node, frozenset(used))
        elif kind == "expire":
            _, kept = o
            store.expire(lambda r, kept=kept: r.uid == kept)  # type: ignore[misc]
        elif kind == "remap":
            _, node, known = o
            order = sorted(known)
            store.remap(node, lambda i, order=order: order.index(i) if i in order else None)  # type: ignore[misc]
        else:
            now[0] += o[1]
        for uid in UIDS:
            assert sorted(store.of_pod(uid), key=lambda r: r.node) == sorted(
                (r for r in store.all() if r.uid == uid), key=lambda r: r.node)
