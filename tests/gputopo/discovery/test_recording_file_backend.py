"""The replay backend over a recording file that a test rewrites: NVML's answers change when the file does (a
re-partition as NVML shows it), and a file that no longer reads keeps the last good recording."""

from __future__ import annotations

from pathlib import Path

from gputopo.core.mig import A100_80GB
from gputopo.discovery.nvml_mig import discover_mig
from gputopo.discovery.recording import RecordingFileBackend
from tests.helpers.mig import ALL_1G, BALANCED_80, mig_recording, write_recording


def names(backend: RecordingFileBackend) -> list[list[str | None]]:
    gpu = (7, "GPU-a1000007-5e7d-4000-8000-000000000007")
    return [[d.name for d in g.devices] for g in discover_mig(backend, [gpu])]


def test_a_rewritten_recording_is_answered_and_a_broken_one_is_not(tmp_path: Path) -> None:
    path = write_recording(tmp_path / "rec.json", mig_recording(A100_80GB, [None] * 7 + [list(ALL_1G)]))
    backend = RecordingFileBackend(path)
    backend.init()
    assert names(backend) == [["1g.10gb"] * 7]
    write_recording(path, mig_recording(A100_80GB, [None] * 7 + [list(BALANCED_80)]))
    assert names(backend) == [["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]]
    path.write_text('{"format": "gpuplugin.nvml-recording", "gpus": "not a list"}')
    assert names(backend) == [["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]]
    assert backend.device_count() == 8
    write_recording(path, mig_recording(A100_80GB, [None] * 7 + [[("7g.80gb", 0, (7,))]]))
    assert names(backend) == [["7g.80gb"]]
