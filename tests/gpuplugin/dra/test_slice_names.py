"""The driver knows its own slices by name, also where the apiserver cut the generateName short: on a node with a
long name (EKS: ip-10-0-12-34.us-west-2.compute.internal) it took its slices for someone else's, deleted and
recreated the whole pool on every sync, and the pool offered nothing while each new generation was incomplete."""

from __future__ import annotations

from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.publisher import SlicePublisher
from gpuplugin.dra.slices import parse_slice_index, slice_name_prefix
from gputopo.kube import make_api_client
from tests.fakes.kubeapi import FakeDraKubeApi
from tests.gpuplugin.dra.conftest import DGX1, DRIVER, TAINT, catalog

LONG_NODE = "ip-10-0-12-34.us-west-2.compute.internal"


def test_a_pool_on_a_node_with_a_long_name_is_written_once() -> None:
    with FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": LONG_NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            publisher = SlicePublisher(api, PoolPlanner(catalog(str(DGX1)), taint_key=TAINT),
                                       lambda: (set(), set()), driver=DRIVER, node=LONG_NODE, watch_claims=False)
            assert [w.op for w in publisher.sync()] == ["create"] * 4
            names = sorted(s["metadata"]["name"] for s in fake.slices(LONG_NODE))
            assert all(len(n) == 63 for n in names)  # the apiserver's cut
            assert publisher.sync() == [] and publisher.sync() == []
            assert sorted(s["metadata"]["name"] for s in fake.slices(LONG_NODE)) == names
        finally:
            api.close()


def test_only_names_completed_from_our_prefix_count_as_ours() -> None:
    full = slice_name_prefix(3, DRIVER, LONG_NODE)
    assert parse_slice_index(full[:58] + "x7k2p", DRIVER, LONG_NODE) == 3
    assert parse_slice_index(slice_name_prefix(3, DRIVER, "n1") + "x7k2p", DRIVER, "n1") == 3
    for name in (full[:58], "00003-" + DRIVER + "-ip-10-0-12-35.us-west-2.compute.internalx7k2p"[:63],
                 "0x003-" + full[6:58] + "x7k2p", "000003-" + full[6:], slice_name_prefix(3, DRIVER, "n1")[:-1],
                 f"n1-{DRIVER}-00003", "left-over"):
        assert parse_slice_index(name, DRIVER, LONG_NODE if "ip-" in name else "n1") is None, name
