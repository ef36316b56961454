"""discover() over replayed NVML: the real H200 answers, synthetic boards cross-checked against real text dumps,
and every degraded answer NVML can give (NotSupported, binding mismatches, links down, MIG, fabric partitions)."""

from __future__ import annotations

import ctypes.util
from typing import Any

import pynvml
import pytest

from gputopo.core.topology import Link, LinkKind
from gputopo.discovery import nvml_backend as nb
from gputopo.discovery.nvml import DiscoveryError, discover, discover_node, format_cpu_set
from gputopo.discovery.nvml_backend import LiveNvmlBackend, NvmlError, NvmlUnavailableError, normalize_bus_id
from gputopo.discovery.nvml_replay import ReplayNvmlBackend
from gputopo.discovery.smi_text import parse_nvidia_smi_topo
from tests.fixtures.nvml import DGX1, H200_PROBE, H200_RECORDED, HGX, canonical
from tests.helpers.paths import SHARED

NS = "ERR:NVMLError_NotSupported:Not Supported"


def replay(rec: dict[str, Any]) -> ReplayNvmlBackend:
    backend = ReplayNvmlBackend(rec)
    backend.init()
    return backend


def links_of(topo: Any) -> set[str]:
    return {topo.link(i, j).label for i in range(topo.size) for j in range(i + 1, topo.size)}


# --- real and realistic machines ---------------------------------------------------------------------------------


def test_h200_probe_is_two_gpus_on_an_nvswitch_with_18_nvlink4_lanes_and_no_numa() -> None:
    node = discover_node(replay(canonical(H200_PROBE)))
    topo = node.topology
    assert topo.ids == ("GPU-30482642-1815-347d-42f6-f41f43f97e01", "GPU-20b58ddd-cb81-1ae9-b420-d83856eb4609")
    assert topo.link(0, 1) == Link(LinkKind.NVSWITCH, 18, 4)
    assert topo.fabric == "nvswitch"
    assert [g.numa_node for g in topo.gpus] == [None, None]
    assert [g.cpu_affinity for g in topo.gpus] == [None, None]  # the probe kept a Python repr, not the mask
    assert [g.pci_bus_id for g in topo.gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert {g.model for g in topo.gpus} == {"NVIDIA H200"}
    assert [g.memory_mib for g in topo.gpus] == [143771, 143771]
    assert topo.pcie_generation == 5
    assert [(d.nvml_index, d.minor, d.compute_capability) for d in node.devices] == [(0, 0, (9, 0)), (1, 1, (9, 0))]
    assert node.driver_version == "580.159.04"
    assert node.excluded == ()


def test_h200_recorded_by_gpuplugin_record_matches_the_probe_and_has_the_real_cpu_set() -> None:
    node = discover_node(replay(canonical(H200_RECORDED)))
    topo = node.topology
    assert topo.link(0, 1) == Link(LinkKind.NVSWITCH, 18, 4)
    assert [g.numa_node for g in topo.gpus] == [None, None]  # NVML: not supported; sysfs: -1
    assert [g.cpu_affinity for g in topo.gpus] == ["0-31", "0-31"]  # as `nvidia-smi topo -m` printed there
    assert topo.fingerprint == discover(replay(canonical(H200_PROBE))).fingerprint
    text = parse_nvidia_smi_topo((SHARED / "recordings" / "h200x2-vm-nvidia-smi-topo-m.txt").read_text())
    assert topo.gbps(0, 1) == text.gbps(0, 1)  # text reads NV18 as a direct pair: same bandwidth


def test_dgx1_direct_nvlinks_match_the_real_nvidia_smi_dump_of_that_machine() -> None:
    topo = discover(replay(canonical(DGX1)))
    text = parse_nvidia_smi_topo((SHARED / "topologies" / "dgx1-v100-ucxpy.txt").read_text())
    assert topo.links == text.links
    assert topo.link(0, 3) == Link(LinkKind.NVLINK, 2, 2)
    assert topo.link(0, 5).kind is LinkKind.SYS
    assert [g.cpu_affinity for g in topo.gpus] == [g.cpu_affinity for g in text.gpus]
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.fabric == "nvlink" and topo.pcie_generation == 3


def test_hgx_switch_links_with_real_switch_bus_ids_match_the_real_dump() -> None:
    topo = discover(replay(canonical(HGX)))
    text = parse_nvidia_smi_topo((SHARED / "topologies" / "hgx-a100-8gpu-epyc7763-pleiades.txt").read_text())
    assert topo.links == text.links
    assert links_of(topo) == {"SW12"}
    # NVML has no NUMA id there; sysfs has.
    assert [g.numa_node for g in topo.gpus] == [g.numa_node for g in text.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert [g.cpu_affinity for g in topo.gpus] == [g.cpu_affinity for g in text.gpus]


# --- NVLink semantics ----------------------------------------------------------------------------------------------


def test_links_down_lower_the_lane_count_of_that_pair_only() -> None:
    rec = canonical(DGX1)
    # GPU0 links 2, 3 go to GPU3 (NV2). One goes down, on both ends.
    rec["gpus"][0]["nvlinks"][2]["state"] = 0
    peer_link = next(lk for lk in rec["gpus"][3]["nvlinks"] if lk["remote_bus_id"] == rec["gpus"][0]["pci_bus_id"])
    peer_link["state"] = 0
    topo = discover(replay(rec))
    assert topo.link(0, 3) == Link(LinkKind.NVLINK, 1, 2)
    assert topo.link(0, 4) == Link(LinkKind.NVLINK, 2, 2)


def test_switch_lanes_are_the_smaller_live_count_of_the_two_gpus() -> None:
    rec = canonical(HGX)
    for lk in rec["gpus"][5]["nvlinks"][:4]:
        lk["state"] = 0
    topo = discover(replay(rec))
    assert topo.link(5, 0) == Link(LinkKind.NVSWITCH, 8, 3)
    assert topo.link(1, 0) == Link(LinkKind.NVSWITCH, 12, 3)
    assert topo.gbps(5, 0) < topo.gbps(1, 0)


def test_gpu_without_live_switch_links_falls_back_to_pcie() -> None:
    rec = canonical(HGX)
    for lk in rec["gpus"][7]["nvlinks"]:
        lk["state"] = 0
    topo = discover(replay(rec))
    assert topo.link(7, 6).kind is LinkKind.PXB  # same NUMA node: common ancestor MULTIPLE
    assert topo.link(7, 0).kind is LinkKind.SYS
    assert topo.link(0, 1).kind is LinkKind.NVSWITCH


def test_switch_recognised_by_bus_id_alone_when_remote_type_is_unsupported() -> None:
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        for lk in g["nvlinks"]:
            lk["remote_type"] = NS
    assert discover(replay(rec)).link(0, 1) == Link(LinkKind.NVSWITCH, 18, 4)


def test_fabric_partition_denied_by_p2p_status_is_not_an_nvswitch_pair() -> None:
    rec = canonical(HGX)
    for a, b in ((0, 4), (4, 0)):
        rec["pairs"][f"{a}-{b}"]["p2p_nvlink"] = 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    topo = discover(replay(rec))
    assert topo.link(0, 4).kind is LinkKind.SYS
    assert topo.link(0, 5).kind is LinkKind.NVSWITCH


def test_unknown_p2p_status_does_not_veto_the_switch() -> None:
    rec = canonical(HGX)
    for key in rec["pairs"]:
        rec["pairs"][key]["p2p_nvlink"] = "ERR:ArgumentError:argument 3: TypeError: Don't know how to convert"
    assert links_of(discover(replay(rec))) == {"SW12"}


def test_generation_from_model_when_nvml_has_no_version() -> None:
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        for lk in g["nvlinks"]:
            lk["version"] = NS
    assert discover(replay(rec)).link(0, 1).generation == 4
    for g in rec["gpus"]:
        g["name"] = "Some Future GPU"
    assert discover(replay(rec)).link(0, 1).generation == 1  # floor: still NVLink, never above what is known


def test_links_to_unknown_remotes_are_ignored_not_guessed() -> None:
    rec = canonical(DGX1)
    for lk in rec["gpus"][0]["nvlinks"]:
        lk["remote_bus_id"] = "00000000:F0:00.0"  # a GPU this container does not see
        lk["remote_type"] = 0
    for g in rec["gpus"][1:]:
        g["nvlinks"] = [lk for lk in g["nvlinks"] if lk["remote_bus_id"] != "00000000:06:00.0"]
    topo = discover(replay(rec))
    assert topo.link(0, 1).kind is LinkKind.PIX
    assert topo.link(0, 4).kind is LinkKind.SYS
    assert topo.link(1, 3) == Link(LinkKind.NVLINK, 1, 2)


def test_remote_bus_ids_in_other_spellings_still_match_their_gpu() -> None:
    rec = canonical(DGX1)
    for g in rec["gpus"]:
        for lk in g["nvlinks"]:
            domain, rest = lk["remote_bus_id"].split(":", 1)
            lk["remote_bus_id"] = f"{int(domain, 16):04x}:{rest.lower()}"  # sysfs style
    assert discover(replay(rec)).links == discover(replay(canonical(DGX1))).links


# --- PCIe ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "kind"),
    [(0, LinkKind.PIX), (10, LinkKind.PIX), (20, LinkKind.PXB), (30, LinkKind.PHB), (40, LinkKind.NODE),
     (50, LinkKind.SYS), (NS, LinkKind.SYS)],
)
def test_common_ancestor_levels_map_to_pcie_classes(level: Any, kind: LinkKind) -> None:
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        g["nvlinks"] = []
    rec["pairs"]["0-1"]["common_ancestor"] = level
    assert discover(replay(rec)).link(0, 1) == Link(kind)


def test_the_h200_vm_ancestor_30_is_pynvml_hostbridge() -> None:
    """The shared README calls 30 SYSTEM; pynvml says HOSTBRIDGE (SYSTEM is 50). Discovery follows pynvml."""
    assert pynvml.NVML_TOPOLOGY_HOSTBRIDGE == 30 and pynvml.NVML_TOPOLOGY_SYSTEM == 50
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        g["nvlinks"] = []
    assert discover(replay(rec)).link(0, 1) == Link(LinkKind.PHB)


def test_pcie_generation_is_the_slowest_gpus_max_clamped_to_known_generations() -> None:
    rec = canonical(DGX1)
    rec["gpus"][3]["pcie_max_gen"] = 2
    assert discover(replay(rec)).pcie_generation == 3
    for g in rec["gpus"]:
        g["pcie_max_gen"] = NS
    assert discover(replay(rec)).pcie_generation == 3  # NVLink 2 ships with Gen3


# --- per-GPU facts ---------------------------------------------------------------------------------------------------


def test_numa_prefers_nvml_then_sysfs_and_minus_one_means_none() -> None:
    rec = canonical(DGX1)
    rec["gpus"][0]["numa_node"] = NS
    rec["gpus"][0]["sysfs_numa_node"] = 1
    rec["gpus"][1]["numa_node"] = -1
    rec["gpus"][1]["sysfs_numa_node"] = -1
    rec["gpus"][2]["numa_node"] = NS
    rec["gpus"][2]["sysfs_numa_node"] = "ERR:FileNotFoundError:no such file"
    assert [g.numa_node for g in discover(replay(rec)).gpus][:4] == [1, None, None, 0]


def test_mig_enabled_gpus_are_left_out_and_reported() -> None:
    rec = canonical(HGX)
    rec["gpus"][2]["mig_mode"] = [1, 1]
    node = discover_node(replay(rec))
    assert node.topology.size == 7
    assert rec["gpus"][2]["uuid"] not in node.topology.ids
    assert [(x.nvml_index, x.reason) for x in node.excluded] == [(2, "MIG enabled")]
    assert [d.nvml_index for d in node.devices] == [0, 1, 3, 4, 5, 6, 7]
    assert node.nvml_index_to_id()[3] == rec["gpus"][3]["uuid"]
    assert links_of(node.topology) == {"SW12"}


def test_a_gpu_without_uuid_is_excluded_and_the_rest_discovered() -> None:
    rec = canonical(DGX1)
    rec["gpus"][7]["uuid"] = "ERR:NVMLError_GpuIsLost:GPU is lost"
    node = discover_node(replay(rec))
    assert node.topology.size == 7
    assert node.excluded[0].reason == "uuid unavailable"


def test_no_usable_gpu_is_a_discovery_error_listing_the_excluded() -> None:
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        g["mig_mode"] = [1, 0]
    with pytest.raises(DiscoveryError, match="no usable GPU") as info:
        discover(replay(rec))
    assert len(info.value.excluded) == 2


def test_an_nvml_that_cannot_count_gpus_is_a_discovery_error() -> None:
    with pytest.raises(DiscoveryError, match="Uninitialized"):
        discover(ReplayNvmlBackend(canonical(H200_PROBE)))  # never init()ed


def test_everything_unsupported_still_gives_a_topology() -> None:
    rec = canonical(H200_PROBE)
    for g in rec["gpus"]:
        for key in list(g):
            if key not in ("index", "uuid", "nvlinks"):
                g[key] = NS
        g["nvlinks"] = []
    rec["pairs"] = {}
    rec["driver"] = NS
    node = discover_node(replay(rec))
    assert node.topology.link(0, 1) == Link(LinkKind.SYS)
    assert node.topology.gpus[0].model is None and node.topology.gpus[0].memory_mib is None
    assert node.driver_version is None


@pytest.mark.parametrize(
    ("words", "text"),
    [([0], None), ([0b1], "0"), ([0xFFFFFFFF], "0-31"), ([(1 << 20) - 1 | ((1 << 20) - 1) << 40], "0-19,40-59"),
     ([1 << 63, 1], "63-64"), ([0b1010], "1,3"), ([0, 0xF], "64-67")],
)
def test_cpu_masks_print_as_cpuset_lists(words: list[int], text: str | None) -> None:
    assert format_cpu_set(words) == text


# --- the live backend against the real pynvml ------------------------------------------------------------------------


def test_backend_constants_equal_pynvml() -> None:
    for name in ("NVML_NVLINK_MAX_LINKS", "NVML_FEATURE_ENABLED", "NVML_NVLINK_DEVICE_TYPE_GPU",
                 "NVML_NVLINK_DEVICE_TYPE_IBMNPU", "NVML_NVLINK_DEVICE_TYPE_SWITCH", "NVML_NVLINK_DEVICE_TYPE_UNKNOWN",
                 "NVML_TOPOLOGY_INTERNAL", "NVML_TOPOLOGY_SINGLE", "NVML_TOPOLOGY_MULTIPLE",
                 "NVML_TOPOLOGY_HOSTBRIDGE", "NVML_TOPOLOGY_NODE", "NVML_TOPOLOGY_SYSTEM",
                 "NVML_P2P_CAPS_INDEX_NVLINK", "NVML_P2P_STATUS_OK", "NVML_DEVICE_MIG_ENABLE",
                 "NVML_DEVICE_MIG_DISABLE", "NVML_GPU_INSTANCE_PROFILE_COUNT", "NVML_COMPUTE_INSTANCE_PROFILE_COUNT",
                 "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", "nvmlEventTypeXidCriticalError"):
        assert getattr(nb, name) == getattr(pynvml, name), name
    for name in (nb.ERR_NOT_SUPPORTED, nb.ERR_INVALID_ARGUMENT, nb.ERR_GPU_IS_LOST, nb.ERR_TIMEOUT, nb.ERR_NOT_FOUND,
                 nb.ERR_NO_PERMISSION):
        assert issubclass(getattr(pynvml, name), pynvml.NVMLError), name


def test_every_pynvml_function_the_live_backend_calls_exists_with_that_arity() -> None:
    import inspect
    import re
    from pathlib import Path

    source = Path(nb.__file__).read_text()
    calls = set(re.findall(r'"(nvml[A-Za-z0-9_]+)"', source))
    assert {"nvmlDeviceGetNvLinkRemotePciInfo", "nvmlEventSetWait", "nvmlDeviceGetCpuAffinity"} <= calls
    arity = {  # arguments the backend passes (handle counted)
        "nvmlDeviceGetCpuAffinity": 2, "nvmlDeviceGetNvLinkState": 2, "nvmlDeviceGetNvLinkVersion": 2,
        "nvmlDeviceGetNvLinkRemotePciInfo": 2, "nvmlDeviceGetNvLinkRemoteDeviceType": 2,
        "nvmlDeviceGetTopologyCommonAncestor": 2, "nvmlDeviceGetP2PStatus": 3, "nvmlDeviceRegisterEvents": 3,
        "nvmlEventSetWait": 2, "nvmlEventSetCreate": 0, "nvmlDeviceGetCount": 0, "nvmlDeviceGetHandleByIndex": 1,
        "nvmlInit": 0, "nvmlShutdown": 0, "nvmlSystemGetDriverVersion": 0, "nvmlSystemGetNVMLVersion": 0,
        # MIG
        "nvmlDeviceGetMigDeviceHandleByIndex": 2, "nvmlDeviceGetGpuInstanceProfileInfo": 3,
        "nvmlDeviceGetGpuInstancePossiblePlacements": 4, "nvmlDeviceGetGpuInstanceRemainingCapacity": 2,
        "nvmlDeviceGetGpuInstanceById": 2, "nvmlGpuInstanceGetComputeInstanceById": 2,
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": 3,
    }
    for name in calls:
        fn = getattr(pynvml, name)
        params = inspect.signature(fn).parameters.values()
        required = sum(1 for p in params if p.default is inspect.Parameter.empty)
        want = arity.get(name, 1)
        assert required <= want <= len(inspect.signature(fn).parameters), (name, required, want)


@pytest.mark.skipif(bool(ctypes.util.find_library("nvidia-ml")), reason="an NVIDIA driver is installed here")
def test_live_backend_without_a_driver_says_nvml_is_unavailable() -> None:
    backend = LiveNvmlBackend()
    with pytest.raises(NvmlError, match="init"):
        backend.device_count()
    with pytest.raises(NvmlUnavailableError) as info:
        backend.init()
    assert info.value.name == "NVMLError_LibraryNotFound"


@pytest.mark.parametrize(
    ("raw", "norm"),
    [("00000000:3b:00.0", "00000000:3B:00.0"), ("0000:3B:00.0", "00000000:3B:00.0"), ("3b:00.0", "00000000:3B:00.0"),
     ("FFFFFFFF:FF:FF.0", "FFFFFFFF:FF:FF.0")],
)
def test_bus_ids_normalise_to_nvmls_form(raw: str, norm: str) -> None:
    assert normalize_bus_id(raw) == norm
    assert nb.sysfs_pci_name(norm) == (f"{norm[4:8].lower()}:{norm[9:].lower()}")
