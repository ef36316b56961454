"""Hypothesis strategies for well-formed device plugin requests with hostile content: ids that are ours, unicode,
empty, huge (100k characters), repeated, thousands of them; sizes negative, zero, beyond the node, int32 limits;
must-include ids outside available; several container requests per call. Messages stay under the server's 4 MiB
receive limit (the oversize answer is checked separately)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from gpuplugin.proto import deviceplugin_pb2 as pb

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Proto3 strings must be valid UTF-8: no lone surrogates (a client cannot even build such a message).
CHARS = st.characters(codec="utf-8")


def device_id(known: Sequence[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(list(known)),
        st.sampled_from(list(known)),  # twice: most ids in real requests are ours
        st.text(CHARS, max_size=24),
        st.just(""),
        st.sampled_from(["GPU-", " ", "\x00", "../kubelet.sock", "GPU0\n", "🙂" * 8, "nvidia.com/gpu=0"]),
        st.builds(lambda c, n: c * n, CHARS, st.integers(1_000, 100_000)),  # huge, cheap to build
        st.sampled_from(list(known)).map(str.lower),
    )


def id_list(known: Sequence[str]) -> st.SearchStrategy[list[str]]:
    many = st.builds(
        lambda prefix, n, mixed: [f"{prefix}{i}" for i in range(n)] + mixed,
        st.text(CHARS, max_size=6),
        st.integers(1_000, 5_000),
        st.lists(st.sampled_from(list(known)), max_size=8),
    )
    return st.one_of(
        st.lists(device_id(known), max_size=12),
        st.lists(st.sampled_from(list(known)), max_size=20),  # ours, often repeated
        st.permutations(list(known)),
        st.lists(st.sampled_from(list(known)), unique=True),
        many,
    )


def sizes(node_size: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(-2, node_size + 2),
        st.integers(INT32_MIN, INT32_MAX),
        st.sampled_from([INT32_MIN, -1, 0, 1, node_size, node_size + 1, INT32_MAX]),
    )


def container_preferred(known: Sequence[str]) -> st.SearchStrategy[pb.ContainerPreferredAllocationRequest]:
    ids = id_list(known)
    return st.builds(
        lambda available, must, extra, size: pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=(must or available[:2]) + extra, allocation_size=size
        ),
        ids,
        st.lists(device_id(known), max_size=4),
        st.lists(st.sampled_from(list(known)), max_size=3),  # must-include often outside available
        sizes(len(known)),
    )


def preferred_requests(known: Sequence[str]) -> st.SearchStrategy[pb.PreferredAllocationRequest]:
    return st.builds(
        lambda cs: pb.PreferredAllocationRequest(container_requests=cs),
        st.lists(container_preferred(known), max_size=3),
    )


def allocate_requests(known: Sequence[str]) -> st.SearchStrategy[pb.AllocateRequest]:
    return st.builds(
        lambda cs: pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in cs]),
        st.lists(id_list(known), max_size=3),
    )
