"""Shared GPUs (consumable capacity) and MIG instances through the DRA driver, end to end on one node: the replayed
H100 80GB mixed node (4 whole GPUs, 4 MIG-enabled GPUs), real gRPC on unix sockets to the kubelet stand-in, the
official client against the in-process apiserver (which validates capacity request policies as validation.go
does, or plays an apiserver that drops or refuses them). Claims are allocated as the scheduler writes them, with
the recorded shapes plus the KEP-5075 result fields (shareID, consumedCapacity)."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.cdi import CdiWriter
from gpuplugin.dra.driver import ClaimKey, Driver
from gpuplugin.dra.metrics import DraMetrics
from gpuplugin.dra.partitions import (
    CapacityError,
    check_capacity,
    gpus_to_share,
    mig_devices,
    mps_shares,
    shared_devices,
)
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.publisher import SlicePublisher
from gpuplugin.dra.server import DraServer
from gpuplugin.dra.state import StateFile
from gpuplugin.sharing.config import parse_config
from gpuplugin.sharing.layout import Layout, resolve
from gputopo.discovery.nvml import NodeDiscovery, discover_node
from gputopo.discovery.recording import replay_backend
from gputopo.kube import make_api_client
from gputopo.kube.dra import get_claim
from sim.dra_kubelet import DraKubeletSim, PrepareError
from tests.fakes.kubeapi import FakeDraKubeApi
from tests.fakes.kubeapi.dra import _capacity_problem
from tests.fixtures.nvml import RECORDINGS, load_json
from tests.gpuplugin.dra.conftest import DRIVER, NODE, RECORDED_CLAIM, TAINT
from tests.helpers.paths import SHARED, short_dir
from tests.helpers.polling import eventually

H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
RECORDED_SLICE = SHARED / "recordings" / "kube-apiserver-dra" / "resourceslice-counter-consuming-devices.json"


def sharing(strategy: str = "timeSlicing", replicas: int = 4, fail: bool | None = None) -> str:
    flag = "" if fail is None else f"\n    failRequestsGreaterThanOne: {str(fail).lower()}"
    return f"""version: v1
sharing:
  {strategy}:{flag}
    resources:
      - name: nvidia.com/gpu
        rename: nvidia.com/gpu.shared
        replicas: {replicas}
        devices: [0, 1]
"""


def h100() -> NodeDiscovery:
    return discover_node(replay_backend(load_json(H100_MIXED)))


@dataclass
class Node:
    fake: FakeDraKubeApi
    api: Any
    root: Path
    driver: Driver
    publisher: SlicePublisher
    kubelet: DraKubeletSim
    metrics: DraMetrics
    found: NodeDiscovery
    layout: Layout

    def devices(self) -> dict[str, dict]:
        return {d["name"]: d for s in self.fake.slices(NODE) for d in s["spec"].get("devices") or ()}

    def settled(self) -> bool:
        def ok() -> bool:
            s = self.fake.slices(NODE)
            return bool(s) and len({x["spec"]["pool"]["generation"] for x in s}) == 1 and \
                len(s) == s[0]["spec"]["pool"]["resourceSliceCount"]
        return eventually(lambda: ok() and not self.publisher.sync(), 15.0)

    def claim(self, name: str, results: list[dict]) -> tuple[str, str, str]:
        body = json.loads(RECORDED_CLAIM.read_text())
        body["metadata"] = {"name": name, "namespace": "default"}
        created = self.fake.add_claim(body)
        self.fake.allocate_claim("default", name, NODE, results)
        return ("default", created["metadata"]["uid"], name)

    def prepare(self, key: tuple[str, str, str]) -> list:
        return self.kubelet.prepare(DRIVER, [key])[key[1]]

    def refusal(self, key: tuple[str, str, str]) -> str:
        with pytest.raises(PrepareError) as e:
            self.prepare(key)
        return str(e.value)

    def cdi(self, uid: str) -> dict:
        return json.loads((self.root / "cdi" / f"{DRIVER}-claim_{uid}.json").read_text())


def share(device: str = "shared-0", replicas: str = "1", memory: str | None = None, **extra: Any) -> dict:
    consumed = {"replicas": replicas} | ({"memory": memory} if memory else {})
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, "shareID": str(uuid.uuid4()),
            "consumedCapacity": consumed} | extra


@pytest.fixture
def make_node() -> Iterator[Any]:
    started: list[tuple[Any, ...]] = []

    def start(config: str | None = sharing(), capacity: str = "on") -> Node:
        found = h100()
        layout = resolve(parse_config(config or "version: v1"), found.topology, "nvidia.com/gpu")
        to_share, _ = gpus_to_share(layout, ())
        shared = [d for d in shared_devices(found.topology, layout) if d.gpus[0] in to_share]
        migs, skipped = mig_devices(found.mig)
        assert not skipped
        catalog = Catalog.build(found.topology, exclude=to_share, extra=[*shared, *migs])
        fallback = Catalog.build(found.topology, extra=migs)
        dirs = short_dir("drash-")
        root = dirs.__enter__()
        fake = FakeDraKubeApi(capacity=capacity).__enter__()
        fake.add_node({"metadata": {"name": NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        metrics = DraMetrics()
        box: list[SlicePublisher] = []
        driver = Driver(catalog, driver_name=DRIVER, pool=NODE, state=StateFile(root / "plugin" / "state.json"),
                        cdi=CdiWriter(root / "cdi", DRIVER), get_claim=lambda ns, n: get_claim(api, ns, n),
                        metrics=metrics, mps=mps_shares(found.topology, layout, to_share, root / "mps"),
                        on_change=lambda: box[0].request() if box else None)
        publisher = SlicePublisher(api, PoolPlanner(catalog, taint_key=TAINT, fallback=fallback,
                                                    on_fallback=driver.use_catalog,
                                                    sick_devices=driver.sick_devices),
                                   lambda: (driver.used_gpus(), driver.unhealthy_gpus()), driver=DRIVER, node=NODE,
                                   metrics=metrics, min_interval_s=0.0)
        box.append(publisher)
        publisher.start()
        server = DraServer(driver, root / "registry", root / "plugin", poll_interval_s=0.1).start()
        kubelet = DraKubeletSim(root / "registry", NODE, api, slice_grace_s=0.5).start()
        started.append((kubelet, server, publisher, api, fake, dirs))
        kubelet.wait_registered(DRIVER)
        return Node(fake, api, root, driver, publisher, kubelet, metrics, found, layout)

    yield start
    for kubelet, server, publisher, api, fake, dirs in started:
        kubelet.stop()
        server.stop()
        publisher.stop()
        api.close()
        fake.__exit__(None, None, None)
        dirs.__exit__(None, None, None)


def metric(node: Node, name: str, **labels: str) -> float | None:
    return node.metrics.registry.get_sample_value(name, labels or None)


# ---- what is published ----


def test_shared_gpus_and_mig_instances_are_published_in_the_1_36_shapes(make_node: Any) -> None:
    node = make_node()
    assert node.settled()
    for s in node.fake.slices(NODE):  # the apiserver's own schema for 1.36, strict: no field it does not know
        kubernetes_validate.validate(s, "1.36.0", strict=True)
    devices = node.devices()
    gpu0 = node.found.topology.gpus[0]
    share_mib = gpu0.memory_mib // 4
    assert devices["shared-0"] == {
        "name": "shared-0",
        "attributes": {"size": {"int": 1}, "order": {"string": "shared"}, "uuid": {"string": gpu0.id},
                       "sharing": {"string": "time-slicing"}, "model": {"string": gpu0.model}},
        "capacity": {
            "replicas": {"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4",
                                                                                        "step": "1"}}},
            "memory": {"value": f"{4 * share_mib}Mi", "requestPolicy": {
                "default": f"{share_mib}Mi",
                "validRange": {"min": f"{share_mib}Mi", "max": f"{4 * share_mib}Mi", "step": f"{share_mib}Mi"}}},
        },
        "allowMultipleAllocations": True,
    }
    # shared GPUs are never offered whole, nor in a set; the GPUs left whole are, with their counters
    assert {"shared-0", "shared-1", "gpu-2", "gpu-3", "one-2", "set-2-3"} <= set(devices)
    assert not {"gpu-0", "one-1", "set-0-1", "set-0-2", "shared-2"} & set(devices)
    # every MIG device that exists, with its profile and placement; two compute instances of one GI are two devices
    expected = {(m.nvml_index, d.gpu_instance_id, d.compute_instance_id): (m, d) for m in node.found.mig
                for d in m.devices}
    migs = {n: d for n, d in devices.items() if n.startswith("mig-")}
    assert len(migs) == len(expected) > 0
    for (gpu, gi, ci), (m, d) in expected.items():
        a = migs[f"mig-{gpu}-{gi}-{ci}"]["attributes"]
        assert a["profile"] == {"string": d.name} and a["uuid"] == {"string": d.uuid}
        assert a["parentUUID"] == {"string": m.uuid} and a["parentIndex"] == {"int": m.nvml_index}
        assert (a["placementStart"], a["placementSize"]) == ({"int": d.placement.start}, {"int": d.placement.size})
        assert migs[f"mig-{gpu}-{gi}-{ci}"]["capacity"]["memory"] == {"value": str(d.memory_bytes)}
        assert "consumesCounters" not in migs[f"mig-{gpu}-{gi}-{ci}"]
    assert sum(1 for a in migs.values() if a["attributes"]["profile"]["string"] == "1c.2g.20gb") == 2
    # attribute shapes as in the recorded objects: one typed value each, within the per-device limits
    recorded = json.loads(RECORDED_SLICE.read_text())["spec"]["devices"][0]["attributes"]
    assert {k for v in recorded.values() for k in v} <= {"int", "string", "bool"}
    for d in devices.values():
        assert len(d["attributes"]) + len(d.get("capacity", {})) <= 32
        assert all(len(k) <= 32 and len(v) == 1 and len(str(next(iter(v.values())))) <= 64
                   for k, v in d["attributes"].items())
    assert metric(node, "gpuplugin_dra_consumable_capacity") == 1


@pytest.mark.parametrize("capacity, reason", [("off", "dropped"), ("invalid", "invalid")])
def test_an_apiserver_that_drops_or_refuses_shared_devices_gets_whole_gpus(make_node: Any, capacity: str,
                                                                           reason: str) -> None:
    node = make_node(capacity=capacity)
    assert node.settled()
    devices = node.devices()
    assert not [n for n in devices if n.startswith("shared-")]
    assert {"gpu-0", "gpu-1", "one-0", "set-0-1"} <= set(devices) and any(n.startswith("mig-") for n in devices)
    assert metric(node, "gpuplugin_dra_consumable_capacity") == 0
    assert metric(node, "gpuplugin_dra_capacity_refusals_total", reason=reason) == 1
    # the driver serves the whole-GPU catalog now: a claim for GPU 0 whole prepares
    key = node.claim("whole-0", [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}])
    (d,) = node.prepare(key)
    assert d.device_name == "gpu-0" and not d.HasField("share_id")


# ---- prepare ----


def test_claims_share_a_gpu_with_the_replica_environment_and_never_beyond_its_capacity(make_node: Any) -> None:
    node = make_node(sharing("mps", fail=False))
    assert node.settled()
    gpu0 = node.found.topology.gpus[0]
    share_mib = gpu0.memory_mib // 4
    first = share()
    key = node.claim("infer-0", [first])
    (d,) = node.prepare(key)
    assert d.device_name == "shared-0" and d.share_id == first["shareID"]
    assert d.cdi_device_ids == [f"{DRIVER}/gpu={key[1]}-shared-0", f"nvidia.com/gpu={gpu0.id}"]
    edits = node.cdi(key[1])["devices"][0]["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    pipe = str(node.root / "mps" / "nvidia.com/gpu.shared" / "pipe")
    # one replica of four: what the device plugin's Allocate gives one replica under MPS
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={gpu0.memory_mib // 4}M"}
    assert {"hostPath": pipe, "containerPath": pipe, "options": ["rbind", "rw"]} in edits["mounts"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert node.prepare(key) == [d]  # a repeat answers the same
    # a claim asking two shares' memory gets two shares' limits
    two = node.claim("infer-2", [share(replicas="1", memory=f"{2 * share_mib}Mi")])
    node.prepare(two)
    env2 = dict(e.split("=", 1) for e in node.cdi(two[1])["devices"][0]["containerEdits"]["env"])
    assert env2["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    # 3 of 4 replicas held (1 + 1, and 2 shares' memory): one more replica fits, then nothing
    node.prepare(node.claim("infer-3", [share()]))
    assert "beyond what is left" in node.refusal(node.claim("infer-4", [share()]))
    node.kubelet.unprepare(DRIVER, [key])
    node.prepare(node.claim("infer-5", [share()]))  # a share given back is there again


def test_fail_requests_greater_than_one_caps_what_one_request_may_take(make_node: Any) -> None:
    node = make_node(sharing("mps"))  # NVIDIA's default under MPS: failRequestsGreaterThanOne true
    assert node.settled()
    policy = node.devices()["shared-0"]["capacity"]["replicas"]["requestPolicy"]
    assert policy == {"default": "1", "validRange": {"min": "1", "max": "1", "step": "1"}}
    assert "not a whole number from 1 to 1" in node.refusal(node.claim("two", [share(replicas="2")]))
    node.prepare(node.claim("one", [share()]))


@pytest.mark.parametrize("mutate, words", [
    (lambda r: r["consumedCapacity"].update(replicas="5"), "not a whole number from 1 to 4"),
    (lambda r: r["consumedCapacity"].update(replicas="1500m"), "not a whole number from 1 to 4"),
    (lambda r: r["consumedCapacity"].update(replicas="lots"), "not a Kubernetes quantity"),
    (lambda r: r["consumedCapacity"].update(memory="1Pi"), "beyond the"),
    (lambda r: r["consumedCapacity"].update(cores="2"), "does not have"),
    (lambda r: r.update(consumedCapacity=["replicas"]), "must be a map"),
    (lambda r: r.update(shareID="x'; DROP TABLE claims; --"), "is not a UUID"),
    (lambda r: r.update(shareID=7), "is not a UUID"),
    (lambda r: r.update(device="gpu-2"), "is not shared"),
    (lambda r: r.update(device="shared-9"), "does not have"),
])
def test_hostile_capacity_results_are_refused_naming_the_field(make_node: Any, mutate: Any, words: str) -> None:
    node = make_node()
    assert node.settled()
    result = share()
    mutate(result)
    assert words in node.refusal(node.claim("hostile", [result]))
    assert node.driver.prepared() == {}
    node.prepare(node.claim("fine", [share()]))  # everyone else is still served


def test_too_many_results_and_hostile_claim_config_are_refused(make_node: Any) -> None:
    node = make_node()
    assert node.settled()
    assert "allows 32" in node.refusal(node.claim("many", [share() for _ in range(33)]))
    key = node.claim("cfg", [share()])
    node.fake.allocate_claim("default", "cfg", NODE, [share()], [
        {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "env": {"NVIDIA_VISIBLE_DEVICES": "all"}}}}])
    assert "NVIDIA_*" in node.refusal(key)


def test_a_mig_instance_prepares_once_with_its_device_nodes(make_node: Any) -> None:
    node = make_node(None)
    assert node.settled()
    (m, d) = next((m, d) for m in node.found.mig for d in m.devices if d.name == "1g.10gb")
    name = f"mig-{m.nvml_index}-{d.gpu_instance_id}-{d.compute_instance_id}"
    key = node.claim("mig-a", [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": name}])
    (dev,) = node.prepare(key)
    assert dev.device_name == name and dev.cdi_device_ids[1] == f"nvidia.com/gpu={d.uuid}"
    edits = node.cdi(key[1])["devices"][0]["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == list(d.device_nodes) and len(d.device_nodes) == 3
    again = node.claim("mig-b", [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": name}])
    assert "refusing to hand an instance out twice" in node.refusal(again)


def test_an_instance_xid_taints_that_mig_device_alone_and_refuses_new_claims_of_it(make_node: Any) -> None:
    node = make_node(None)
    assert node.settled()
    seven = next(m for m in node.found.mig if m.nvml_index == 7)
    sick, other = seven.devices[0], seven.devices[1]
    sick_name, other_name = (f"mig-7-{d.gpu_instance_id}-{d.compute_instance_id}" for d in (sick, other))
    stream = node.kubelet.watch_health(DRIVER, timeout=20)
    assert all(d.health == 1 for d in next(stream).devices)
    node.driver.set_instance_health([sick.uuid], healthy=False, reason="Xid 94 on GI 1 CI 0")
    update = {d.device.device_name: d for d in next(stream).devices}
    stream.cancel()
    assert update[sick_name].health == 2 and "Xid 94" in update[sick_name].message
    assert update[other_name].health == 1
    assert node.settled()
    tainted = {n for n, d in node.devices().items() if d.get("taints")}
    assert tainted == {sick_name}
    key = node.claim("on-sick", [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": sick_name}])
    assert "unhealthy MIG instances" in node.refusal(key)
    node.driver.set_instance_health([sick.uuid], healthy=True)
    assert node.settled() and not any(d.get("taints") for d in node.devices().values())
    node.prepare(key)


def test_a_claim_for_a_mig_instance_that_no_longer_exists_is_refused_by_name(make_node: Any) -> None:
    node = make_node(None)
    assert node.settled()
    key = node.claim("gone", [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": "mig-7-13-0"}])
    words = node.refusal(key)
    assert "'mig-7-13-0'" in words and "MIG instance destroyed" in words


# ---- pure parts ----


def test_a_gpu_held_whole_is_shared_only_after_its_claim_ends() -> None:
    found = h100()
    layout = resolve(parse_config(sharing()), found.topology, "nvidia.com/gpu")
    assert gpus_to_share(layout, ["set-0-2", "shared-1"]) == ({1: 4}, [0])
    assert gpus_to_share(layout, []) == ({0: 4, 1: 4}, [])


GOOD = {"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}}


def _with(path: tuple[str, ...], value: Any) -> dict:
    out = copy.deepcopy(GOOD)
    at = out
    for k in path[:-1]:
        at = at[k]
    if value is None:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return out


@pytest.mark.parametrize("cap", [
    _with(("requestPolicy", "validValues"), ["1", "2"]),  # both policies
    _with(("requestPolicy", "default"), None),  # a range needs a default
    _with(("requestPolicy", "default"), "5"),  # default above max
    _with(("requestPolicy", "validRange", "min"), "5"),  # min above the value
    _with(("requestPolicy", "validRange", "max"), "8"),  # max above the value
    _with(("requestPolicy", "validRange", "step"), "2"),  # max not a whole number of steps from min
    _with(("requestPolicy", "validRange", "step"), "4"),  # one step beyond the value
    {"value": "4", "requestPolicy": {"default": "3", "validValues": ["1", "2", "4"]}},  # default not a value
    {"value": "4", "requestPolicy": {"default": "1", "validValues": ["2", "1"]}},  # not ascending
])
def test_capacity_rules_agree_with_the_apiserver_model(cap: dict) -> None:
    assert _capacity_problem(GOOD, True) is None
    check_capacity("replicas", GOOD, multi=True)
    assert _capacity_problem(cap, True) is not None
    with pytest.raises(CapacityError):
        check_capacity("replicas", cap, multi=True)


def test_a_request_policy_without_multiple_allocations_is_refused() -> None:
    assert "allowMultipleAllocations must be true" in _capacity_problem(GOOD, False)[1]
    with pytest.raises(CapacityError, match="allowMultipleAllocations must be true"):
        check_capacity("replicas", GOOD, multi=False)


def test_a_restarted_driver_keeps_counting_the_shares_prepared_before(make_node: Any) -> None:
    node = make_node(sharing(replicas=2))
    assert node.settled()
    first = share()
    key = node.claim("held", [first])
    node.prepare(key)
    # a second driver on the same state file (the DaemonSet pod restarted): the share is still held
    again = Driver(node.driver.catalog, driver_name=DRIVER, pool=NODE, state=StateFile(node.root / "plugin" /
                   "state.json"), cdi=CdiWriter(node.root / "cdi", DRIVER),
                   get_claim=lambda ns, n: get_claim(node.api, ns, n))
    (held,) = again.prepared()[key[1]].devices
    assert (held.share_id, held.replicas) == (first["shareID"], 1)
    ns, uid, name = node.claim("second", [share()])
    third = node.claim("third", [share()])
    assert not isinstance(again.prepare([ClaimKey(ns, uid, name)])[uid], str)
    assert "beyond what is left" in again.prepare([ClaimKey(*third)])[third[1]]


@pytest.mark.parametrize(("fail", "threads"), [(False, 100), (True, 25)])
def test_mps_daemon_defaults_allow_what_one_claim_may_take(fail: bool, threads: int) -> None:
    """A client's env can only lower the daemon's defaults, so where a claim may take all four shares of a GPU the
    defaults must be the whole GPU; under failRequestsGreaterThanOne one share."""
    found = h100()
    layout = resolve(parse_config(sharing("mps", fail=fail)), found.topology, "nvidia.com/gpu")
    to_share, _ = gpus_to_share(layout, ())
    shares = mps_shares(found.topology, layout, to_share, Path("/run/nvidia/mps"))
    (share,) = set(shares.values())
    assert share.default_commands()[0] == f"set_default_active_thread_percentage {threads}"
