"""Devices, names, order and slices for every shared machine: inside the apiserver's limits, valid against the
Kubernetes 1.36 schemas, and in the shape of the recorded slices."""

from __future__ import annotations

import itertools
import json
import re

import kubernetes_validate
import pytest

from bench.common import shared_topology_files
from gpuplugin.dra.catalog import (
    ONE,
    RINGS,
    Catalog,
    CatalogError,
    device_name,
    parse_device_name,
    set_group,
    standard_pci_bus_id,
)
from gpuplugin.dra.ordering import publication_order
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.slices import MAX_DEVICES_PER_SLICE, slice_object
from sim.machines import nvswitch_node, pcie_bridge_server
from tests.gpuplugin.dra.conftest import DGX1, DRIVER, NODE, TAINT, catalog, topology
from tests.helpers.paths import SHARED

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
RECORDED = SHARED / "recordings" / "kube-apiserver-dra"


def rendered(cat: Catalog, used=(), unhealthy=()) -> list[dict]:
    contents = PoolPlanner(cat, taint_key=TAINT).wanted(used, unhealthy)
    out = []
    for i, content in enumerate(contents):
        obj = slice_object(content, driver=DRIVER, node=NODE, generation=1, count=len(contents))
        obj["metadata"] = {"name": f"{i:05x}-{DRIVER}-{NODE}-abcde"}
        out.append(obj)
    return out


def limit_problems(slices: list[dict]) -> list[str]:
    """The validation rules of docs/reference/dra-api.md section 5 that a schema cannot express."""
    found = []
    names: set[str] = set()
    for s in slices:
        spec = s["spec"]
        if ("devices" in spec) == ("sharedCounters" in spec):
            found.append("exactly one of devices and sharedCounters")
        for cs in spec.get("sharedCounters", []):
            found += [f"counter set {cs['name']}: {len(cs['counters'])} counters"] if len(cs["counters"]) > 32 else []
        devices = spec.get("devices", [])
        if len(devices) > MAX_DEVICES_PER_SLICE:
            found.append(f"{len(devices)} devices in one slice")
        for d in devices:
            if not DNS_LABEL.match(d["name"]) or d["name"] in names:
                found.append(f"device name {d['name']!r}")
            names.add(d["name"])
            if len(d["consumesCounters"]) > 2 or any(len(c["counters"]) > 32 for c in d["consumesCounters"]):
                found.append(f"{d['name']}: counters")
            if len(d["attributes"]) > 32:
                found.append(f"{d['name']}: attributes")
            for key, value in d["attributes"].items():
                local = key.rpartition("/")[2]
                if len(local) > 32 or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", local):
                    found.append(f"{d['name']}: attribute key {key}")
                if isinstance(next(iter(value.values())), str) and len(next(iter(value.values()))) > 64:
                    found.append(f"{d['name']}: attribute {key} value too long")
    return found


@pytest.mark.parametrize("path", shared_topology_files(), ids=lambda p: p.stem)
def test_every_shared_machine_publishes_within_limits_and_schema(path) -> None:
    cat = catalog(str(path))
    n = cat.topology.size
    assert all(o.complete for o in cat.offered)
    slices = rendered(cat, used=[0], unhealthy=[n - 1])
    assert limit_problems(slices) == []
    for s in slices:
        kubernetes_validate.validate(s, "1.36.0", strict=True)
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    assert len(devices) == len(cat.devices)
    tainted = [d["name"] for d in devices if d.get("taints")]
    assert tainted and all(n - 1 in parse_device_name(name) for name in tainted)


def test_shapes_follow_the_recorded_slices() -> None:
    recorded = json.loads((RECORDED / "resourceslice-counter-consuming-devices.json").read_text())
    counters = json.loads((RECORDED / "resourceslice-sharedcounters.json").read_text())
    slices = rendered(catalog(str(DGX1)))
    assert slices[0]["spec"]["sharedCounters"] == counters["spec"]["sharedCounters"]
    assert set(slices[0]["spec"]) == set(counters["spec"]) - {"devices"} | {"sharedCounters"}
    ours = {d["name"]: d for s in slices[1:] for d in s["spec"]["devices"]}
    theirs = recorded["spec"]["devices"]
    assert ours["gpu-0"]["consumesCounters"] == ours["one-0"]["consumesCounters"] == theirs[0]["consumesCounters"]
    assert ours["set-0-3"]["consumesCounters"] == next(d for d in theirs if d["name"] == "pair-0-3")["consumesCounters"]
    # the same best-first order of pairs as the real trial's DGX-1 ranking
    pairs = [n for n in publication_order(catalog(str(DGX1)))[set_group(2)]]
    assert [p.replace("set-", "pair-") for p in pairs] == [d["name"] for d in theirs if d["name"].startswith("pair")]


def test_names_are_a_function_of_the_members() -> None:
    for members in [(3,), (0, 3), (0, 1, 2, 3), tuple(range(16, 32))]:
        assert parse_device_name(device_name(members)) == members
        assert len(device_name(members)) <= 63
    assert device_name((3,)) == "gpu-3" and device_name((3,), ONE) == "one-3" and parse_device_name("one-3") == (3,)
    for bad in ["gpu-", "set-3", "set-3-1", "pair-0-1", "set-1-1", "gpu-1-2", "one-1-2", "two-1"]:
        assert parse_device_name(bad) is None
    with pytest.raises(ValueError, match="single-GPU group"):
        device_name((3,), "set-2")
    assert standard_pci_bus_id("00000000:07:00.0") == "0000:07:00.0"
    assert standard_pci_bus_id("garbage") is None


def test_every_gpu_is_offered_in_both_single_groups_with_one_counter_and_a_telling_attribute() -> None:
    cat = catalog(str(DGX1))
    assert list(cat.groups)[:2] == [RINGS, ONE]
    for group, order in ((RINGS, "rings"), (ONE, "one")):
        devices = [cat.devices[n] for n in cat.groups[group]]
        assert sorted(d.gpus for d in devices) == [(g,) for g in range(8)]
        assert {d.attributes["order"]["string"] for d in devices} == {order}
    assert "order" not in cat.devices["set-0-3"].attributes
    assert cat.summary().startswith("115 devices: 2 x 8 single GPUs, all 28 sets of 2")


def test_a_node_too_big_for_its_sets_offers_the_best_few_per_size_and_says_how_many() -> None:
    cat = Catalog.build(pcie_bridge_server(16), max_devices=400)
    assert len(cat.devices) == 400
    offered = {o.size: o for o in cat.offered}
    assert offered[1].complete and offered[2].complete and offered[16].complete
    assert not offered[4].complete and not offered[8].complete
    assert "of 1820 sets of 4" in cat.summary()
    # every GPU is in some quad and some 8-set: losing GPUs does not empty a size
    for size in (4, 8):
        assert set(itertools.chain(*(cat.devices[n].gpus for n in cat.groups[set_group(size)]))) == set(range(16))
    assert limit_problems(rendered(cat)) == []


def test_held_devices_stay_offered_whatever_the_budget() -> None:
    topo = pcie_bridge_server(16)
    small = Catalog.build(topo, max_devices=64)
    outside = next(device_name(m) for m in itertools.combinations(range(16), 4) if device_name(m) not in small.devices)
    kept = Catalog.build(topo, max_devices=64, keep=[outside])
    assert outside in kept.devices
    with pytest.raises(CatalogError, match="not a device of this"):
        Catalog.build(topo, keep=["set-3-99"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"set_sizes": [1]}, "set sizes must be within"),
    ({"set_sizes": [32]}, "set sizes must be within"),
    ({"max_devices": 15}, "fewer than the node's 16 single-GPU devices"),
])
def test_bad_options_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        Catalog.build(topology(str(DGX1)), **kwargs)


def test_nodes_beyond_one_counter_set_are_refused() -> None:
    with pytest.raises(CatalogError, match="at most 32 GPUs"):
        Catalog.build(nvswitch_node(40, 18, 4))
