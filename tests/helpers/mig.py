"""MIG layouts for tests: recordings built from NVIDIA's profile tables (tests/fixtures/mig_recordings.py, the same
builder as the committed fixtures) and swapped in place under a running plugin, which replays them through
`--nvml-recording` (gputopo.discovery.recording.RecordingFileBackend re-reads a changed file): a re-partition as
NVML would show it. And the host device nodes a MIG Allocate answer names, made under a test's dev root."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gputopo.core.mig import ProfileTable
from tests.fixtures.mig_recordings import ALL_1G, BALANCED_80, Layout, build

__all__ = ["ALL_1G", "BALANCED_80", "make_dev_nodes", "mig_recording", "write_recording"]


def mig_recording(table: ProfileTable, layouts: list[Layout], note: str = "built by a test") -> dict[str, Any]:
    """An 8-GPU HGX recording of `table`'s model, GPU k partitioned as `layouts[k]` (None: MIG disabled)."""
    return build(table, layouts, note)


def write_recording(path: Path, recording: dict[str, Any]) -> Path:
    """Write `recording` to `path` in one step (beside it, then rename), as a replay must never read half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(recording))
    os.replace(tmp, path)
    return path


def make_dev_nodes(dev_root: Path, paths: Iterable[str]) -> None:
    """Empty files standing for the host's device nodes (`/dev/nvidia4`, ...) under `dev_root`: Allocate names a
    node only when the host has it."""
    for p in paths:
        target = dev_root / p.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
