"""NVIDIA's MIG strategies on the replayed MIG recordings: what each advertises, and what is refused and why
(a `single` node that is not uniform, `single` beside whole GPUs, MPS on a MIG GPU, a bad flags.migStrategy)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuplugin.sharing.config import SharingConfigError, parse_config
from gpuplugin.sharing.layout import MigView, resolve, share_mig
from gpuplugin.sharing.mig_strategy import MigPlan, MigStrategy, plan_mig
from gputopo.core.mig import A100_80GB, H100_80GB
from gputopo.discovery.nvml import DiscoveryError, discover_node
from gputopo.discovery.nvml_mig import MigGpu
from gputopo.discovery.recording import replay_backend
from tests.fixtures.nvml import RECORDINGS, canonical
from tests.helpers.mig import ALL_1G, BALANCED_80, mig_recording

GPU = "nvidia.com/gpu"
A100_SINGLE = RECORDINGS / "synthetic-hgx-a100-80gb-8gpu-mig-single.json"
H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
H200_MIXED = RECORDINGS / "synthetic-hgx-h200-141gb-8gpu-mig-mixed.json"


def mig_of(recording: dict[str, Any]) -> tuple[tuple[MigGpu, ...], int, Any]:
    """(MIG GPUs, whole GPU count, topology or None) as `gpuplugin run` discovers them."""
    try:
        node = discover_node(replay_backend(recording))
    except DiscoveryError as e:
        return e.mig, 0, None
    return node.mig, node.topology.size, node.topology


def plan(recording: dict[str, Any], strategy: MigStrategy) -> MigPlan:
    gpus, whole, _ = mig_of(recording)
    return plan_mig(strategy, gpus, whole, GPU)


def test_mixed_advertises_one_resource_per_profile_and_leaves_sub_profiles_out() -> None:
    p = plan(canonical(H100_MIXED), MigStrategy.MIXED)
    assert p.counts() == {"nvidia.com/mig-1g.10gb": 10, "nvidia.com/mig-1g.10gb.me": 1, "nvidia.com/mig-1g.20gb": 1,
                          "nvidia.com/mig-2g.20gb": 1, "nvidia.com/mig-3g.40gb": 3}
    assert p.refused is None
    # GPU 7's 2g.20gb split into two 1c compute instances: NVIDIA's mixed strategy advertises neither
    assert sorted(p.left_out.values()) == [
        "1c.2g.20gb is a compute-instance sub-profile; NVIDIA's mixed strategy advertises no resource for it"] * 2
    ids = [i.uuid for insts in p.resources.values() for i in insts]
    assert all(x.startswith("MIG-") for x in ids) and len(set(ids)) == len(ids)
    h200 = plan(canonical(H200_MIXED), MigStrategy.MIXED)
    assert h200.counts() == {"nvidia.com/mig-1g.18gb": 4, "nvidia.com/mig-2g.35gb": 2, "nvidia.com/mig-3g.71gb": 3,
                             "nvidia.com/mig-4g.71gb": 1, "nvidia.com/mig-7g.141gb": 1}


def test_single_serves_a_uniform_node_as_the_whole_gpu_resource() -> None:
    p = plan(canonical(A100_SINGLE), MigStrategy.SINGLE)
    assert p.counts() == {GPU: 56} and p.refused is None and not p.left_out


def test_single_refuses_a_node_that_is_not_uniform_naming_the_layout() -> None:
    rec = mig_recording(A100_80GB, [list(ALL_1G)] * 7 + [list(BALANCED_80)])
    p = plan(rec, MigStrategy.SINGLE)
    assert p.resources == {}
    assert p.refused is not None and "not uniform" in p.refused
    assert "GPU-a1000007-5e7d-4000-8000-000000000007: 2x 1g.10gb, 1x 2g.20gb, 1x 3g.40gb" in p.refused
    assert "GPU-a1000000-5e7d-4000-8000-000000000000: 7x 1g.10gb" in p.refused
    assert len(p.left_out) == 8  # every MIG GPU, each with the refusal


def test_single_beside_whole_gpus_is_refused_and_the_whole_gpus_stay() -> None:
    rec = canonical(H100_MIXED)
    gpus, whole, _ = mig_of(rec)
    assert whole == 4
    p = plan_mig(MigStrategy.SINGLE, gpus, whole, GPU)
    assert p.resources == {} and p.refused is not None and "4 GPU(s) of this node are not" in p.refused


def test_none_leaves_every_mig_gpu_out_with_its_reason() -> None:
    p = plan(canonical(H100_MIXED), MigStrategy.NONE)
    assert p.resources == {}
    assert sorted(p.left_out) == [f"GPU-b100000{k}-5e7d-4000-8000-00000000000{k}" for k in (4, 5, 6, 7)]
    assert all("none MIG strategy" in why for why in p.left_out.values())


def test_flags_mig_strategy_is_read_and_a_bad_value_names_its_field() -> None:
    assert parse_config("version: v1\nflags:\n  migStrategy: Mixed\n").mig_strategy is MigStrategy.MIXED
    assert parse_config("version: v1\n").mig_strategy is None
    with pytest.raises(SharingConfigError) as e:
        parse_config("version: v1\nflags:\n  migStrategy: partial\n", "cfg")
    assert e.value.field == "flags.migStrategy" and "'partial' is not a MIG strategy" in str(e.value)


MPS_ON = """version: v1
sharing:
  mps:
    resources:
    - name: {name}
      replicas: 2
      devices: {devices}
"""


@pytest.mark.parametrize(("name", "devices", "field"), [
    ("nvidia.com/gpu", '["GPU-b1000005-5e7d-4000-8000-000000000005"]', "sharing.mps.resources[0].devices[0]"),
    ("nvidia.com/gpu", '["MIG-b1050100-5e7d-4000-8000-000000000000"]', "sharing.mps.resources[0].devices[0]"),
    ("nvidia.com/mig-1g.10gb", "all", "sharing.mps.resources[0].name"),
])
def test_mps_on_a_mig_gpu_is_refused_at_config_time(name: str, devices: str, field: str) -> None:
    gpus, _, topology = mig_of(canonical(H100_MIXED))
    p = plan_mig(MigStrategy.MIXED, gpus, 4, GPU)
    view = MigView({k: frozenset(v) for k, v in p.ids().items()}, frozenset(g.uuid for g in gpus if g.enabled))
    config = parse_config(MPS_ON.format(name=name, devices=devices))
    with pytest.raises(SharingConfigError) as e:
        resolve(config, topology, GPU, view)
    assert e.value.field == field and "MIG and MPS on one GPU are refused" in str(e.value)
    # the same MPS config on the whole GPUs is served
    whole = resolve(parse_config(MPS_ON.format(name=GPU, devices="all")), topology, GPU, view)
    assert whole.shared[0].gpus == (0, 1, 2, 3)


def test_h100_table_layouts_build_a_valid_recording() -> None:
    rec = mig_recording(H100_80GB, [None] * 4 + [list(ALL_1G)] * 4)
    assert plan(rec, MigStrategy.MIXED).counts() == {"nvidia.com/mig-1g.10gb": 28}


TS_ON = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: {name}
      replicas: 2
      rename: {rename}
      devices: {devices}
"""


@pytest.mark.parametrize(("name", "rename", "devices", "field", "message"), [
    ("nvidia.com/mig-1g.10gb", "nvidia.com/mig.shared", '["MIG-b1050300-5e7d-4000-8000-000000000002"]',
     "sharing.timeSlicing.resources[0].devices[0]", "is not a MIG device of nvidia.com/mig-1g.10gb"),
    ("nvidia.com/mig-4g.40gb", "nvidia.com/mig.shared", "all", "sharing.timeSlicing.resources[0].name",
     "nvidia.com/mig-4g.40gb is not served on this node"),
    ("nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb", "all", "sharing.timeSlicing.resources[0].rename",
     "rename clash"),
    ("nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb", "2", "sharing.timeSlicing.resources[0].rename",
     "rename clash"),
])
def test_time_slicing_of_mig_devices_refuses_what_it_cannot_serve(name: str, rename: str, devices: str, field: str,
                                                                  message: str) -> None:
    gpus, _, _ = mig_of(canonical(H100_MIXED))
    p = plan_mig(MigStrategy.MIXED, gpus, 4, GPU)
    config = parse_config(TS_ON.format(name=name, rename=rename, devices=devices))
    with pytest.raises(SharingConfigError) as e:
        share_mig(config, p.resources, GPU)
    assert e.value.field == field and message in str(e.value)


def test_time_slicing_of_mig_devices_replicates_the_named_ones() -> None:
    gpus, _, _ = mig_of(canonical(H100_MIXED))
    p = plan_mig(MigStrategy.MIXED, gpus, 4, GPU)
    config = parse_config(TS_ON.format(name="nvidia.com/mig-3g.40gb", rename="nvidia.com/mig-3g.40gb.shared",
                                       devices="2"))
    out = share_mig(config, p.resources, GPU)
    assert [i.uuid for i in out.resources["nvidia.com/mig-3g.40gb.shared"]] == [
        "MIG-b1050400-5e7d-4000-8000-000000000003", "MIG-b1060100-5e7d-4000-8000-000000000000"]
    assert [i.uuid for i in out.resources["nvidia.com/mig-3g.40gb"]] == ["MIG-b1060200-5e7d-4000-8000-000000000001"]
    assert out.shares["nvidia.com/mig-3g.40gb.shared"].replicas == dict.fromkeys(
        ["MIG-b1050400-5e7d-4000-8000-000000000003", "MIG-b1060100-5e7d-4000-8000-000000000000"], 2)
