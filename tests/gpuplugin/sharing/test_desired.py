"""The MPS desired-state file between the plugin and `gpuplugin mps-control`: written whole (atomic replace), read
back to the same sets, and a hostile or garbled file refused whole with an error naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuplugin.sharing.desired import (
    MAX_DESIRED_BYTES,
    DesiredSet,
    DesiredStateError,
    desired_path,
    encode,
    read_desired,
    write_desired,
)
from gpuplugin.sharing.mps import MpsGpu, MpsShare

GPU = "nvidia.com/gpu"


def _sets(root: Path) -> list[DesiredSet]:
    return [DesiredSet(MpsShare(GPU, root, (MpsGpu("GPU-a", 4, 80000), MpsGpu("GPU-b", 2, None))), 3),
            DesiredSet(MpsShare("example.com/mps", root, (MpsGpu("GPU-c", 7, 1000),), several_per_client=True), 1)]


def test_written_sets_read_back_and_no_file_decides_nothing(tmp_path: Path) -> None:
    assert read_desired(tmp_path) is None
    write_desired(tmp_path, _sets(tmp_path))
    assert read_desired(tmp_path) == {d.share.resource: d for d in _sets(tmp_path)}
    write_desired(tmp_path, [])
    assert read_desired(tmp_path) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["mps-desired.json"]  # no temporary file left behind


def _doc(root: Path) -> dict:
    return json.loads(encode(_sets(root)))


def _with(root: Path, change: str) -> str:
    doc = _doc(root)
    s = doc["sets"][0]
    if change == "version":
        doc["version"] = 2
    elif change == "outside":
        s["pipe_dir"] = "/etc/evil/pipe"
    elif change == "traversal":
        s["resource"], s["pipe_dir"], s["log_dir"] = "../../etc/x", "/etc/x/pipe", "/etc/x/log"
    elif change == "replicas":
        s["gpus"][0]["replicas"] = 1
    elif change == "extra":
        s["command"] = "quit"
    elif change == "twice":
        doc["sets"][1] = s
    elif change == "uuid":
        s["gpus"][0]["uuid"] = "GPU-a\nset_default_active_thread_percentage 100"
    elif change == "no_gpus":
        s["gpus"] = []
    return json.dumps(doc)


@pytest.mark.parametrize(("change", "named"), [
    ("version", "version"),
    ("outside", "pipe_dir '/etc/evil/pipe'"),
    ("traversal", "sets.0.resource"),
    ("replicas", "sets.0.gpus.0.replicas"),
    ("extra", "sets.0.command"),
    ("twice", "listed twice"),
    ("uuid", "sets.0.gpus.0.uuid"),
    ("no_gpus", "sets.0.gpus"),
])
def test_a_hostile_file_is_refused_naming_the_field(tmp_path: Path, change: str, named: str) -> None:
    desired_path(tmp_path).write_text(_with(tmp_path, change))
    with pytest.raises(DesiredStateError) as caught:
        read_desired(tmp_path)
    assert named in str(caught.value) and str(desired_path(tmp_path)) in str(caught.value)


@pytest.mark.parametrize(("content", "named"), [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "(file)"),
    (b" " * (MAX_DESIRED_BYTES + 1), f"larger than {MAX_DESIRED_BYTES} bytes"),
])
def test_a_garbled_file_is_refused(tmp_path: Path, content: bytes, named: str) -> None:
    desired_path(tmp_path).write_bytes(content)
    with pytest.raises(DesiredStateError, match=None) as caught:
        read_desired(tmp_path)
    assert named in str(caught.value)


def test_another_root_is_refused(tmp_path: Path) -> None:
    """The plugin and the keeper must agree on the root: the directories name it."""
    (tmp_path / "a").mkdir()
    write_desired(tmp_path / "a", _sets(tmp_path / "b"))
    with pytest.raises(DesiredStateError, match="share one MPS root"):
        read_desired(tmp_path / "a")
