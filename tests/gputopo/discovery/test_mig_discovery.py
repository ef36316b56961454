"""MIG discovery: the real H200's answers with MIG disabled, and the synthetic MIG recordings replayed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gputopo.core.mig import H100_80GB, H200_141GB, ExistingInstance, check_layout, possible_placements
from gputopo.discovery.mig_minors import parse_mig_minors
from gputopo.discovery.nvml import DiscoveryError, discover_node
from gputopo.discovery.nvml_backend import NvmlError
from gputopo.discovery.nvml_mig import discover_mig, discover_mig_gpu, gpu_profiles
from gputopo.discovery.recording import dump_recording, parse_recording, record, replay_backend
from tests.fixtures import mig_recordings
from tests.fixtures.nvml import H200_RECORDED, RECORDINGS, canonical, load_json

REAL = RECORDINGS / "h200-mig-disabled"
A100_SINGLE = RECORDINGS / "synthetic-hgx-a100-80gb-8gpu-mig-single.json"
H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
H200_MIXED = RECORDINGS / "synthetic-hgx-h200-141gb-8gpu-mig-mixed.json"

_V2_FIELDS = {"id": "id", "sliceCount": "slice_count", "instanceCount": "instance_count",
              "multiprocessorCount": "multiprocessor_count", "copyEngineCount": "copy_engine_count",
              "decoderCount": "decoder_count", "encoderCount": "encoder_count", "jpegCount": "jpeg_count",
              "ofaCount": "ofa_count", "memorySizeMB": "memory_size_mb", "name": "name",
              "isP2pSupported": "is_p2p_supported"}


def real_probe() -> dict[str, Any]:
    return json.loads((REAL / "nvml-mig-queries.json").read_text())


def real_mig_section() -> dict[str, Any]:
    """The real H200's MIG answers (raw pynvml, MIG disabled) in the recording's shape, unchanged in value."""
    g = real_probe()["gpus"][0]
    profiles: dict[str, Any] = {}
    placements: dict[str, Any] = {}
    remaining: dict[str, Any] = {}
    for index, entry in g["gpu_instance_profiles"].items():
        v2 = entry["v2"]
        if isinstance(v2, str):
            profiles[index] = v2
            continue
        profiles[index] = {ours: v2[theirs] for theirs, ours in _V2_FIELDS.items()}
        placements[str(v2["id"])] = entry["placements"]
        remaining[str(v2["id"])] = entry["nvmlDeviceGetGpuInstanceRemainingCapacity"]
    return {"max_devices": g["nvmlDeviceGetMaxMigDeviceCount"], "gi_profiles": profiles, "placements": placements,
            "remaining": remaining, "devices": [], "gpu_instances": {}, "compute_instances": {}, "ci_profiles": {}}


def real_h200_recording() -> dict[str, Any]:
    """GPU 0 of the real H200 recording with the real MIG answers beside it."""
    rec = canonical(H200_RECORDED)
    rec["gpus"] = rec["gpus"][:1]
    rec["pairs"] = {}
    rec["gpus"][0]["mig"] = real_mig_section()
    return parse_recording(rec)


# --- the real H200, MIG disabled --------------------------------------------------------------------------------


def test_the_real_h200_answers_mig_disabled_no_devices_and_not_found_slots() -> None:
    g = real_probe()["gpus"][0]
    assert g["nvmlDeviceGetMigMode"] == [0, 0]
    assert g["nvmlDeviceGetMaxMigDeviceCount"] == 0
    assert set(g["nvmlDeviceGetMigDeviceHandleByIndex"].values()) == {"ERR:NVMLError_NotFound:Not Found"}
    backend = replay_backend(real_h200_recording())
    assert backend.max_mig_device_count(0) == 0
    with pytest.raises(NvmlError) as info:
        backend.mig_device(0, 0)
    assert info.value.name == "NVMLError_NotFound"
    assert discover_mig_gpu(backend, 0, backend.uuid(0), None) is None  # neither enabled nor pending
    node = discover_node(backend)
    assert node.mig == () and node.excluded == () and node.topology.size == 1


def test_profiles_from_the_real_h200_are_nvidias_h200_table_and_names() -> None:
    backend = replay_backend(real_h200_recording())
    problems: list[str] = []
    found = gpu_profiles(backend, 0, backend.memory_total(0), problems)
    assert problems == []
    real_names = {e["v2"]["id"]: e["v2"]["name"] for e in real_probe()["gpus"][0]["gpu_instance_profiles"].values()
                  if isinstance(e["v2"], dict)}
    # go-nvlib's naming rule, applied to NVML's memory sizes, gives the names NVML itself prints
    assert {p.id: f"MIG {p.name}" for p in found} == real_names
    table = {p.id: p for p in H200_141GB.profiles}
    for p in found:
        t = table[p.id]
        assert (p.name, p.compute_slices, p.memory_slices, p.instance_count, p.starts, p.memory_mib,
                p.multiprocessors) == (t.name, t.compute_slices, t.memory_slices, t.instance_count, t.starts,
                                       t.memory_mib, t.multiprocessors)
    # an empty GPU: the core's possible placements are what NVML listed
    for p in found:
        listed = list(backend.gpu_instance_possible_placements(0, p.id))
        assert [(x.start, x.size) for x in possible_placements(p, [])] == listed


def test_the_real_mig_minors_parse_and_match_the_numbering_the_synthetic_recordings_use() -> None:
    minors = parse_mig_minors((REAL / "mig-minors-gpu0.txt").read_text())
    assert minors.bad_lines == ()
    assert len(minors.entries) == 2 + 15 * 9
    assert minors.device_nodes(0, 1, 0) == ("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")
    built = mig_recordings._minors([0])
    assert built == minors.entries
    assert minors.device_nodes(1, 0, 0) is None  # not in the (cut) file


@pytest.mark.parametrize(
    "text",
    ["gpu0/gi1/access x", "gpu0/gi1/access 12 13", "monitor", "gpu0/gi1/ci0/access -1", "../../etc 3"],
)
def test_malformed_mig_minors_lines_are_set_aside_not_guessed(text: str) -> None:
    minors = parse_mig_minors(f"config 1\n{text}\ngpu0/gi1/access 12\n")
    assert minors.entries == {"config": 1, "gpu0/gi1/access": 12}
    assert minors.bad_lines == (text,)


def test_a_name_listed_twice_keeps_its_first_minor() -> None:
    minors = parse_mig_minors("gpu0/gi1/access 12\ngpu0/gi1/access 99\n")
    assert minors.entries == {"gpu0/gi1/access": 12} and minors.bad_lines == ("gpu0/gi1/access 99",)


# --- synthetic MIG recordings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(mig_recordings.FILES))
def test_the_synthetic_mig_recordings_are_what_the_builder_makes(name: str) -> None:
    assert (RECORDINGS / name).read_text() == mig_recordings.render(name)
    # and they are canonical recordings: parsing changes nothing
    data = load_json(RECORDINGS / name)
    assert parse_recording(copy.deepcopy(data)) == data


def test_an_all_mig_a100_node_has_no_whole_gpu_but_every_instance_is_found() -> None:
    with pytest.raises(DiscoveryError) as info:
        discover_node(replay_backend(load_json(A100_SINGLE)))
    mig = info.value.mig
    assert len(mig) == 8 and all(m.enabled and not m.mode_change_pending for m in mig)
    names = {d.name for m in mig for d in m.devices}
    assert names == {"1g.10gb"}
    assert sum(len(m.devices) for m in mig) == 56
    uuids = [d.uuid for m in mig for d in m.devices]
    assert len(set(uuids)) == 56 and all(u.startswith("MIG-") for u in uuids)
    first = mig[1].devices[0]
    assert first.device_nodes == ("/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap147", "/dev/nvidia-caps/nvidia-cap148")
    assert [d.placement.start for d in mig[0].devices if d.placement] == list(range(7))


def test_a_mixed_h100_node_keeps_whole_gpus_and_lists_each_mig_gpu_layout() -> None:
    node = discover_node(replay_backend(load_json(H100_MIXED)))
    assert node.topology.size == 4 and node.topology.fabric == "nvswitch"
    assert [x.nvml_index for x in node.excluded] == [4, 5, 6, 7]
    by_index = {m.nvml_index: m for m in node.mig}
    assert sorted(by_index) == [3, 4, 5, 6, 7]
    pending = by_index[3]
    assert not pending.enabled and pending.mode_change_pending and pending.devices == ()
    assert [d.name for d in by_index[5].devices] == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    seven = by_index[7]
    assert [d.name for d in seven.devices] == ["1g.10gb+me", "1g.20gb", "1c.2g.20gb", "1c.2g.20gb", "1g.10gb"]
    assert [d.advertised_by_mixed for d in seven.devices] == [True, True, False, False, True]
    # the two compute instances of one GI are one GPU instance for the placement model
    assert len(seven.instances()) == 4
    assert {(i.profile.name, i.placement.start) for i in seven.instances()} == {
        ("1g.10gb+me", 0), ("1g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)}
    # what can still be created there: NVML's remaining capacity agrees with the core
    backend = replay_backend(load_json(H100_MIXED))
    for p in H100_80GB.profiles:
        free = possible_placements(p, seven.instances())
        assert backend.gpu_instance_remaining_capacity(7, p.id) == (1 if free else 0), p.name


def test_the_h200_mixed_node_profiles_and_instances() -> None:
    node = discover_node(replay_backend(load_json(H200_MIXED)))
    mig = {m.nvml_index: m for m in node.mig}
    assert [d.name for d in mig[6].devices] == ["4g.71gb", "3g.71gb"]
    assert [d.name for d in mig[7].devices] == ["7g.141gb"]
    assert mig[7].devices[0].memory_bytes == 143360 * 1024 * 1024
    assert all(not m.problems for m in mig.values())


def test_recording_a_replayed_mig_node_gives_the_same_recording() -> None:
    data = load_json(H100_MIXED)
    again = record(replay_backend(data), meta=data["meta"])
    assert again == parse_recording(data)
    assert dump_recording(again) == Path(H100_MIXED).read_text()


def test_recording_an_old_recording_adds_no_mig_section() -> None:
    data = canonical(H200_RECORDED)
    again = record(replay_backend(data), meta=data["meta"])
    assert "mig" not in again["gpus"][0] and "mig_minors" not in again
    assert again == data


def test_a_mig_device_whose_gpu_instance_cannot_be_read_is_listed_without_a_name() -> None:
    data = load_json(H200_MIXED)
    data["gpus"][7]["mig"]["gpu_instances"]["1"] = "ERR:NVMLError_NoPermission:Insufficient Permissions"
    mig = {m.nvml_index: m for m in discover_node(replay_backend(data)).mig}
    dev = mig[7].devices[0]
    assert dev.uuid.startswith("MIG-") and dev.profile is None and dev.name is None and not dev.advertised_by_mixed
    assert any("NoPermission" in p for p in mig[7].problems)
    assert mig[7].instances() == ()


def test_unreadable_mig_minors_leave_devices_without_device_nodes() -> None:
    data = load_json(H200_MIXED)
    data["mig_minors"] = "ERR:PermissionError:/proc/driver/nvidia-caps/mig-minors: denied"
    mig = discover_mig(replay_backend(data), [(7, "GPU-x")])
    assert mig[0].devices[0].device_nodes == () and mig[0].devices[0].name == "7g.141gb"


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("gpus", 4, "mig", "devices", 0, "gpu_instance_id"), -1, "gpu_instance_id"),
        (("gpus", 4, "mig", "placements", "19"), [[0]], "placements"),
        (("gpus", 4, "mig", "gi_profiles", "0", "bogus"), 1, "bogus"),
        (("gpus", 4, "mig", "compute_instances"), {"1-0": {"id": 0, "profile_id": 0, "start": 0, "size": 1}},
         "compute_instances"),
        (("mig_minors",), {"config": -1}, "mig_minors"),
    ],
)
def test_a_malformed_mig_section_is_refused_naming_the_field(path: tuple[Any, ...], value: Any, field: str) -> None:
    from gputopo.discovery.recording import RecordingFormatError

    data = load_json(H200_MIXED)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(RecordingFormatError, match=field):
        parse_recording(data)


def test_existing_instances_of_the_synthetic_layouts_are_valid_nvidia_layouts() -> None:
    for name in mig_recordings.FILES:
        for m in discover_mig(replay_backend(load_json(RECORDINGS / name)), [(i, f"GPU-{i}") for i in range(8)]):
            inst: tuple[ExistingInstance, ...] = m.instances()
            check_layout(inst)
