"""The recording format: round trips through replay, the probe format, the loader, bad input, `gpuplugin record`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from gpuplugin.cli import main
from gputopo.core.errors import TopologyParseError
from gputopo.discovery.loader import load_topology_file
from gputopo.discovery.nvml import discover
from gputopo.discovery.nvml_backend import NvmlError
from gputopo.discovery.recording import (
    RecordingFormatError,
    dump_recording,
    is_probe_format,
    load_recording_dict,
    parse_recording,
    record,
    replay_backend,
)
from tests.fixtures.nvml import ALL_RECORDINGS, DGX1, H200_PROBE, HGX, canonical, load_json
from tests.helpers.paths import REPO


def without_meta(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k != "meta"}


@pytest.mark.parametrize("path", ALL_RECORDINGS, ids=lambda p: p.name)
def test_recording_a_replay_gives_the_recording_back(path: Path) -> None:
    original = canonical(path)
    again = record(replay_backend(original))
    assert without_meta(again) == without_meta(original)
    # ... and through JSON text, as `gpuplugin record` writes it
    assert without_meta(parse_recording(json.loads(dump_recording(again)))) == without_meta(original)


@pytest.mark.parametrize("path", ALL_RECORDINGS, ids=lambda p: p.name)
def test_a_rerecorded_machine_discovers_the_same_topology_as_its_file(path: Path) -> None:
    from_file = load_topology_file(path)
    rerecorded = record(replay_backend(load_json(path)))
    assert discover(replay_backend(rerecorded)) == from_file
    assert load_recording_dict(rerecorded).fingerprint == from_file.fingerprint


def test_failures_are_recorded_as_err_strings_and_replayed_as_the_same_errors() -> None:
    rec = canonical(H200_PROBE)
    assert rec["gpus"][0]["numa_node"] == "ERR:NVMLError_NotSupported:Not Supported"
    backend = replay_backend(rec)
    with pytest.raises(NvmlError) as info:
        backend.numa_node_id(0)
    assert (info.value.name, info.value.message, info.value.call) == (
        "NVMLError_NotSupported", "Not Supported", "nvmlDeviceGetNumaNodeId")
    with pytest.raises(NvmlError) as info:
        backend.nvlink_state(0, 18)  # H200 has links 0-17
    assert info.value.name == "NVMLError_InvalidArgument"
    with pytest.raises(NvmlError) as info:
        backend.sysfs_numa_node(0)  # the probe format has no sysfs answer
    assert info.value.name == "NotRecorded"
    with pytest.raises(NvmlError) as info:
        backend.uuid(2)
    assert info.value.name == "NVMLError_InvalidArgument"
    assert backend.nvlink_remote_pci_bus_id(1, 17) == "FFFFFFFF:FF:FF.0"
    assert backend.p2p_status(0, 1, 2) == 0
    assert backend.cuda_compute_capability(1) == (9, 0)


def test_the_probe_format_converts_with_its_useless_cpu_affinity_unrecorded() -> None:
    probe = load_json(H200_PROBE)
    assert is_probe_format(probe)
    rec = parse_recording(probe)
    assert not is_probe_format(rec)
    gpu = rec["gpus"][0]
    assert gpu["cpu_affinity"].startswith("ERR:NotRecorded:")
    assert gpu["pcie_max_gen"] == 5 and gpu["pcie_cur_gen"] == 5 and gpu["pcie_max_width"] == 16
    assert gpu["nvlinks"][0] == {"link": 0, "state": 1, "version": 6, "remote_bus_id": "FFFFFFFF:FF:FF.0",
                                 "remote_type": 2}
    assert rec["pairs"]["0-1"] == {"common_ancestor": 30, "p2p_nvlink": 0}
    assert rec["meta"]["converted_from"] == "nvml probe"


def test_the_loader_reads_both_recording_forms() -> None:
    for path in (H200_PROBE, HGX):
        assert load_topology_file(path) == load_recording_dict(load_json(path))
    assert load_topology_file(H200_PROBE).fabric == "nvswitch"


def _broken(change: Any) -> dict[str, Any]:
    rec = canonical(DGX1)
    change(rec)
    return rec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(version=2), "version 2 is newer"),
        (lambda r: r.update(format="something-else"), "not an NVML recording"),
        (lambda r: r.update(gpus=[]), "gpus"),
        (lambda r: r["gpus"][1].update(index=5), r"gpus\[1\] has index 5"),
        (lambda r: r["gpus"][0].update(minor="zero"), "gpus.0.minor"),
        (lambda r: r["gpus"][0].update(memory_total=True), "gpus.0.memory_total"),
        (lambda r: r["gpus"][2]["nvlinks"][0].update(state="1"), "gpus.2.nvlinks.0.state"),
        (lambda r: r["gpus"][2]["nvlinks"][0].update(link=99), "gpus.2.nvlinks.0.link"),
        (lambda r: r["gpus"][2]["nvlinks"].append(dict(r["gpus"][2]["nvlinks"][0])), "listed twice"),
        (lambda r: r["gpus"][0].update(numa="0"), "gpus.0.numa"),
        (lambda r: r["pairs"].update({"0-0": {}}), "pairs key '0-0'"),
        (lambda r: r["pairs"].update({"0-9": {}}), "pairs key '0-9'"),
        (lambda r: r["gpus"][0].update(cpu_affinity=[-1]), "gpus.0.cpu_affinity"),
    ],
)
def test_malformed_recordings_name_the_field(change: Any, message: str) -> None:
    with pytest.raises(RecordingFormatError, match=message):
        parse_recording(_broken(change))


def test_recording_errors_are_topology_parse_errors_so_every_loader_caller_catches_them(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(lambda r: r["gpus"][0].update(index="0"))))
    with pytest.raises(TopologyParseError, match=r"gpus\.0\.index"):
        load_topology_file(bad)
    dup = _broken(lambda r: r["gpus"][1].update(uuid=r["gpus"][0]["uuid"]))
    with pytest.raises(RecordingFormatError, match="duplicate GPU ids"):
        load_recording_dict(dup)


def test_probe_format_errors_say_so() -> None:
    probe = load_json(H200_PROBE)
    probe["gpus"][0]["nvlinks"][0]["link"] = "zero"
    with pytest.raises(RecordingFormatError, match=r"converted from the probe format.*gpus.0.nvlinks.0.link"):
        parse_recording(probe)


def test_synthetic_fixtures_say_they_are_synthetic() -> None:
    for path in (DGX1, HGX):
        assert "synthetic" in path.name
        assert load_json(path)["meta"]["synthetic"] is True


# --- gpuplugin record ------------------------------------------------------------------------------------------------


@pytest.fixture
def cli() -> Any:
    yield CliRunner()
    structlog.reset_defaults()  # the command sends logs to stderr; leave the process as it was


def test_record_command_without_nvml_exits_2_with_a_clear_message(cli: CliRunner) -> None:
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("an NVIDIA driver is installed here")
    result = cli.invoke(main, ["record"])
    assert result.exit_code == 2
    assert "NVML is not available here" in result.stderr
    assert "NVMLError_LibraryNotFound" in result.stderr
    assert result.stdout == ""


def test_record_command_converts_the_probe_to_the_recording_format(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "h200.json"
    result = cli.invoke(main, ["record", "--replay", str(H200_PROBE), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "recorded 2 GPU(s) (NVIDIA H200), fabric nvswitch, links SW18" in result.stderr
    written = json.loads(out.read_text())
    assert written["format"] == "gpuplugin.nvml-recording"
    assert written["meta"]["tool"].startswith("gpuplugin record")
    assert without_meta(written) == without_meta(canonical(H200_PROBE))
    assert load_topology_file(out) == load_topology_file(H200_PROBE)


def test_record_command_writes_json_alone_on_stdout(cli: CliRunner) -> None:
    result = cli.invoke(main, ["record", "--replay", str(HGX)])
    assert result.exit_code == 0, result.output
    assert without_meta(json.loads(result.stdout)) == without_meta(canonical(HGX))


def test_record_command_rejects_a_bad_replay_file(cli: CliRunner, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "gpuplugin.nvml-recording", "version": 1, "gpus": [{"index": 1}]}')
    result = cli.invoke(main, ["record", "--replay", str(bad)])
    assert result.exit_code == 1
    assert "gpus[0] has index 1" in result.stderr


def test_record_replay_of_nvidia_smi_text_names_the_right_command(cli: CliRunner, tmp_path: Path) -> None:
    """Issue 14, item 7: the text a user most likely has is `nvidia-smi topo -m`, not a recording."""
    text = REPO / "gputopo" / "data" / "dgx1-v100-hybrid-cube-mesh.txt"
    result = cli.invoke(main, ["record", "--replay", str(text)])
    assert result.exit_code == 1
    assert f"`gpuplugin topo {text}`" in result.stderr and "--topology" in result.stderr
    assert "Expecting value" not in result.stderr  # no raw JSON error
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    result = cli.invoke(main, ["record", "--replay", str(other)])
    assert result.exit_code == 1 and "is not an NVML recording" in result.stderr


def test_record_command_keeps_mig_answers_and_summarises_the_mig_gpus(cli: CliRunner, tmp_path: Path) -> None:
    from tests.fixtures.nvml import RECORDINGS

    for name, says in (
        ("synthetic-hgx-h100-80gb-8gpu-mig-mixed.json",
         "MIG GPU 3 (mode change pending: 1): no MIG devices; MIG GPU 4: 1g.10gb"),
        ("synthetic-hgx-a100-80gb-8gpu-mig-single.json", "replay to no usable topology"),
    ):
        out = tmp_path / name
        result = cli.invoke(main, ["record", "--replay", str(RECORDINGS / name), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert says in result.stderr
        assert "MIG GPU 7: 1g." in result.stderr
        assert without_meta(json.loads(out.read_text())) == without_meta(canonical(RECORDINGS / name))
