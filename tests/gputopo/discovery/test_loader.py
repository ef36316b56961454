"""Loading a topology file of any form, told apart by content, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputopo.core.codec import topology_to_dict, topology_to_json
from gputopo.core.errors import TopologyFormatError, TopologyParseError
from gputopo.core.topology import Topology
from gputopo.discovery.loader import (
    RECORDING_FORMAT,
    load_topology_bytes,
    load_topology_file,
    load_topology_text,
)
from gputopo.discovery.smi_text import parse_nvidia_smi_topo
from tests.helpers.paths import SHARED

TEXT_FIXTURES = [
    p
    for p in [
        *sorted((SHARED / "topologies").glob("*.txt")),
        SHARED / "recordings" / "h200x2-vm-nvidia-smi-topo-m.txt",
    ]
    if "-PARTIAL" not in p.name
]


@pytest.mark.parametrize("path", TEXT_FIXTURES, ids=lambda p: p.name)
def test_text_files_load_as_parsed(path: Path) -> None:
    topo = load_topology_file(path)
    assert topo == parse_nvidia_smi_topo(path.read_text())
    assert load_topology_file(str(path)) == topo


def test_partial_file_error_names_the_path(fixtures_dir: Path) -> None:
    path = fixtures_dir / "topologies" / "pcie-8gpu-2socket-pix-phb-k8s53497-PARTIAL.txt"
    with pytest.raises(TopologyParseError, match="missing row GPU5") as err:
        load_topology_file(path)
    assert str(path) in str(err.value) and err.value.row == "GPU5"


def _dgx1() -> Topology:
    return parse_nvidia_smi_topo((SHARED / "topologies" / "dgx1-v100-ucxpy.txt").read_text())


def test_compact_json_file(tmp_path: Path) -> None:
    topo = _dgx1()
    path = tmp_path / "node.json"
    path.write_text(topology_to_json(topo))
    assert load_topology_file(path) == topo
    pretty = tmp_path / "pretty.json"
    pretty.write_text("\n  " + json.dumps(topology_to_dict(topo), indent=2))
    assert load_topology_file(pretty) == topo


def test_compact_json_of_a_newer_version_names_the_file(tmp_path: Path) -> None:
    data = topology_to_dict(_dgx1())
    data["v"] = 99
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TopologyFormatError, match="version 99 is newer") as err:
        load_topology_file(path)
    assert str(path) in str(err.value)
    data["v"] = 1
    data["links"] = data["links"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(TopologyFormatError, match="'links' must list 28 pairs") as err:
        load_topology_file(path)
    assert str(path) in str(err.value)


def test_recording_json_goes_to_the_recording_loader(fixtures_dir: Path, tmp_path: Path) -> None:
    probe = fixtures_dir / "recordings" / "h200x2-vm-nvml-probe.json"
    data = json.loads(probe.read_text())
    try:
        from gputopo.discovery.recording import load_recording_dict
    except ImportError:
        with pytest.raises(TopologyParseError, match="NVML recording") as err:
            load_topology_file(probe)
        assert str(probe) in str(err.value)
        return
    try:
        expected: Topology | str = load_recording_dict(data)
    except TopologyParseError as e:
        expected = type(e).__name__
    try:
        got: Topology | str = load_topology_file(probe)
    except TopologyParseError as e:
        got = type(e).__name__
    assert got == expected
    if isinstance(got, Topology):  # the recording shows both H200s on an NVSwitch, which text cannot
        assert got.size == 2 and got.fabric == "nvswitch" and got.ids[0].startswith("GPU-")


def test_recording_is_recognised_by_its_format_key(tmp_path: Path) -> None:
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"format": RECORDING_FORMAT, "version": 1, "gpus": []}))
    with pytest.raises(TopologyParseError) as err:
        load_topology_file(path)
    assert str(err.value).startswith(str(path)) and "neither" not in str(err.value)
    try:
        from gputopo.discovery.recording import RECORDING_FORMAT as recording_format
    except ImportError:
        return
    assert recording_format == RECORDING_FORMAT


def test_stdin_text() -> None:
    text = (SHARED / "topologies" / "aws-p4d.24xlarge.txt").read_text()
    topo = load_topology_text(text, "<stdin>")
    assert topo.size == 8 and topo.fabric == "nvswitch"
    with pytest.raises(TopologyParseError, match="<stdin>, row header"):
        load_topology_text("not a topology\n", "<stdin>")


def test_bom_and_crlf_text() -> None:
    text = (SHARED / "topologies" / "aws-g6e.12xlarge-4xL40S.txt").read_text()
    data = b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode()
    assert load_topology_bytes(data, "x.txt") == parse_nvidia_smi_topo(text)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "empty input"),
        (b" \n\t\n", "empty input"),
        (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary content"),
        (b"GPU0 \xff\xfe X", "not UTF-8"),
        (b'{"v": 1, ', "invalid JSON"),
        (b"[" * 200_000 + b"]" * 200_000, "invalid JSON"),
        (b"[1, 2, 3]", "must be an object"),
        (b'{"hello": "world"}', "neither a compact topology"),
        (b'{"gpus": []}', "neither a compact topology"),
    ],
)
def test_bad_files_name_the_path(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "bad.topo"
    path.write_bytes(content)
    with pytest.raises(TopologyParseError, match=words) as err:
        load_topology_file(path)
    assert str(err.value).startswith(str(path))


def test_unreadable_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(TopologyParseError, match="cannot read file") as err:
        load_topology_file(missing)
    assert str(missing) in str(err.value)
    with pytest.raises(TopologyParseError, match="cannot read file") as err:
        load_topology_file(tmp_path)
    assert str(tmp_path) in str(err.value)
