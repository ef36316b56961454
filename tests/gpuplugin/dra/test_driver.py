"""The DRA driver end to end on one node: real gRPC on unix sockets to the kubelet stand-in, the official client
against the in-process apiserver, claims allocated by the documented allocator on the published slices."""

from __future__ import annotations

import json

import pytest

from gpuplugin.dra.catalog import ONE
from gpuplugin.dra.errors import StateError
from gpuplugin.dra.state import StateFile
from sim.dra_kubelet import PrepareError
from tests.gpuplugin.dra.conftest import DRIVER, NODE, DraNode, make_driver


def singles_order(node: DraNode, prefix: str = "gpu-") -> list[str]:
    devices = [d for s in sorted(node.slices(), key=lambda s: s["metadata"]["name"])
               for d in s["spec"].get("devices", [])]
    return [d["name"] for d in devices if d["name"].startswith(prefix)]


def test_registers_publishes_and_recreates_the_slices_the_kubelet_deleted(dra_node: DraNode) -> None:
    plugin = dra_node.kubelet.plugins[DRIVER]
    assert plugin.version == "v1.DRAPlugin" and plugin.endpoint == str(dra_node.server.dra_socket)
    assert dra_node.server.registered.is_set()
    assert dra_node.settled()
    slices = dra_node.slices()
    assert len(slices) == 4 and all(s["metadata"]["ownerReferences"][0]["kind"] == "Node" for s in slices)
    first = {s["metadata"]["name"] for s in slices}
    for s in slices:  # the kubelet's start: every slice of the node goes
        dra_node.fake.delete_slice(s["metadata"]["name"])
    assert dra_node.settled()
    again = dra_node.slices()
    # created again (the generation may or may not go up: that depends on whether a sync saw a partial pool)
    assert len(again) == 4 and first.isdisjoint(s["metadata"]["name"] for s in again)
    def devices(pool: list[dict]) -> list[str]:
        return [d["name"] for s in sorted(pool, key=lambda s: s["metadata"]["name"])
                for d in s["spec"].get("devices", [])]

    assert devices(again) == devices(slices)


def test_prepare_is_idempotent_writes_cdi_and_state_and_republishes(dra_node: DraNode) -> None:
    assert dra_node.settled()
    ns, uid, name = dra_node.claim("train-4", size=4)
    devices = dra_node.kubelet.prepare(DRIVER, [(ns, uid, name)])[uid]
    (device,) = devices
    assert device.pool_name == NODE and device.request_names == ["gpus"] and device.device_name.startswith("set-")
    assert device.cdi_device_ids[0] == f"{DRIVER}/gpu={uid}-{device.device_name}"
    assert len(device.cdi_device_ids) == 5  # ours plus nvidia.com/gpu=<uuid> for each of the 4 GPUs
    spec = json.loads((dra_node.root / "cdi" / f"{DRIVER}-claim_{uid}.json").read_text())
    assert spec["kind"] == f"{DRIVER}/gpu" and len(spec["devices"][0]["containerEdits"]["deviceNodes"]) == 4
    assert dra_node.kubelet.prepare(DRIVER, [(ns, uid, name)])[uid] == devices  # a repeat answers the same
    assert dra_node.settled()
    held = {int(g) for g in device.device_name.removeprefix("set-").split("-")}
    assert {int(n[4:]) for n in singles_order(dra_node)[-4:]} == held  # the held GPUs' singles go last
    # the next quad goes elsewhere, and the driver can tell: two claims never share a GPU
    ns2, uid2, name2 = dra_node.claim("train-4b", size=4)
    (other,) = dra_node.kubelet.prepare(DRIVER, [(ns2, uid2, name2)])[uid2]
    assert held.isdisjoint(int(g) for g in other.device_name.removeprefix("set-").split("-"))
    dra_node.kubelet.unprepare(DRIVER, [(ns, uid, name), ("default", "never-seen", "gone")])
    assert not (dra_node.root / "cdi" / f"{DRIVER}-claim_{uid}.json").exists()
    assert set(dra_node.driver.prepared()) == {uid2}


def test_extended_resource_singles_come_first_free_in_ring_order(dra_node: DraNode) -> None:
    assert dra_node.settled()
    ns, uid, name = dra_node.claim("ext", size=1, count=2)
    got = [d.device_name for d in dra_node.kubelet.prepare(DRIVER, [(ns, uid, name)])[uid]]
    a, b = (int(x[4:]) for x in got)
    assert dra_node.driver.catalog.topology.link(a, b).lanes == 2  # an NV2 pair, not the NV1 the trial got


def test_one_gpu_claims_take_a_gpu_that_breaks_no_block(dra_node: DraNode) -> None:
    """With GPUs 0 and 1 held on a DGX-1, the first free single in ring order lies in the NV2 quad 4-7 (good for
    `nvidia.com/gpu: 2`, bad for a lone GPU); a one-gpu claim gets GPU 2 instead, and the quad stays whole."""
    pair = dra_node.claim("pair", device="set-0-1")
    dra_node.kubelet.prepare(DRIVER, [pair])
    assert dra_node.settled()
    assert singles_order(dra_node)[0] == "gpu-4"
    ns, uid, name = dra_node.claim("one", size=ONE)
    (device,) = dra_node.kubelet.prepare(DRIVER, [(ns, uid, name)])[uid]
    assert device.device_name == "one-2"
    assert device.cdi_device_ids[1:] == [f"nvidia.com/gpu={dra_node.driver.catalog.topology.gpus[2].id}"]
    assert dra_node.settled()
    assert dra_node.driver.used_gpus() == {0, 1, 2}
    assert {int(n[4:]) for n in singles_order(dra_node, "one-")[-3:]} == {0, 1, 2}  # held GPUs go last in both
    assert {int(n[4:]) for n in singles_order(dra_node, "gpu-")[-3:]} == {0, 1, 2}
    ns4, uid4, name4 = dra_node.claim("four", size=4)
    (quad,) = dra_node.kubelet.prepare(DRIVER, [(ns4, uid4, name4)])[uid4]
    assert quad.device_name == "set-4-5-6-7"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "set-0-1-2-9"}, "which node gpu-node-1 does not have"),
    ({"device": "gpu-3", "config": [{"source": "FromClaim", "requests": ["gpus"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "evn": {}}}}]},
     "opaque config 0 for gpu-topology.io is malformed: evn: Extra inputs are not permitted"),
    ({"device": "gpu-3", "config": [{"source": "FromClass", "requests": ["gpus"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "v9", "kind": "GpuConfig"}}}]}, "has apiVersion 'v9'"),
])
def test_bad_claims_fail_clearly_and_leave_nothing_behind(dra_node: DraNode, kwargs: dict, message: str) -> None:
    ns, uid, name = dra_node.claim("bad", **kwargs)
    good = dra_node.claim("good", device="gpu-5")
    with pytest.raises(PrepareError) as e:
        dra_node.kubelet.prepare(DRIVER, [(ns, uid, name), good])
    assert list(e.value.errors) == [uid] and message in e.value.errors[uid]
    assert set(dra_node.driver.prepared()) == {good[1]}  # the other claim of the batch is served
    assert dra_node.driver.cdi.claims_on_disk() == {good[1]}
    assert json.loads((dra_node.root / "plugin" / "state.json").read_text())["claims"].keys() == {good[1]}


def test_unallocated_missing_and_recreated_claims_are_refused(dra_node: DraNode) -> None:
    ns, _, name = dra_node.claim("x", device="gpu-1")
    with pytest.raises(PrepareError) as e:
        dra_node.kubelet.prepare(DRIVER, [(ns, "another-uid", name), (ns, "u2", "no-such-claim")])
    assert "the kubelet asked for 'another-uid'" in e.value.errors["another-uid"]
    assert "404" in e.value.errors["u2"]
    assert dra_node.driver.prepared() == {}


def test_a_gpu_turning_unhealthy_taints_its_devices_and_refuses_new_prepares(dra_node: DraNode) -> None:
    assert dra_node.settled()
    held = dra_node.claim("held", device="set-0-3")
    dra_node.kubelet.prepare(DRIVER, [held])
    stream = dra_node.kubelet.watch_health(DRIVER, timeout=20)
    first = next(stream)
    assert all(d.health == 1 for d in first.devices)
    gpu3 = dra_node.driver.catalog.topology.gpus[3].id
    dra_node.driver.set_health([gpu3], healthy=False, reason="Xid 79")
    update = next(stream)
    sick = {d.device.device_name: d.message for d in update.devices if d.health == 2}
    assert "set-0-3" in sick and "Xid 79" in sick["set-0-3"] and "gpu-5" not in sick
    stream.cancel()
    assert dra_node.settled()
    tainted = {d["name"] for s in dra_node.slices() for d in s["spec"].get("devices", []) if d.get("taints")}
    assert tainted == {n for n, d in dra_node.driver.catalog.devices.items() if 3 in d.gpus}
    dra_node.kubelet.unprepare(DRIVER, [held])  # the held claim still releases cleanly
    assert dra_node.driver.prepared() == {} and dra_node.driver.cdi.claims_on_disk() == set()
    new = dra_node.claim("new", device="set-2-3")  # allocated before the taint reached the scheduler
    with pytest.raises(PrepareError, match=r"unhealthy GPUs: GPU 3 .*Xid 79"):
        dra_node.kubelet.prepare(DRIVER, [new])


def test_state_survives_a_restart_and_a_corrupt_file_stops_the_driver(dra_node: DraNode) -> None:
    ns, uid, name = dra_node.claim("keep", device="set-4-7")
    before = dra_node.kubelet.prepare(DRIVER, [(ns, uid, name)])[uid]
    restarted, _ = make_driver(dra_node.api, dra_node.root)
    again = restarted.prepare([type("K", (), {"namespace": ns, "uid": uid, "name": name})()])[uid]
    assert [d.device for d in again] == [d.device_name for d in before]
    assert restarted.used_gpus() == {4, 7}
    (dra_node.root / "plugin" / "state.json").write_text("{not json")
    with pytest.raises(StateError, match=r"state\.json is unreadable"):
        StateFile(dra_node.root / "plugin" / "state.json").load()
