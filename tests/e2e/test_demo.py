"""The README's first command, end to end: real plugin processes, kubelet simulators, the extender on uvicorn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_places_pods_honours_plans_and_cleans_up(tmp_path: Path) -> None:
    before = set(Path("/tmp").glob("gpu-demo-*"))
    out = subprocess.run(
        [sys.executable, "-m", "gpuplugin.cli", "demo", "--pods", "14", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "cluster up: 5 nodes" in text
    assert re.search(r"\[14/14\] ", text)
    honoured = re.search(r"plans honoured by the plugin: (\d+)/(\d+)", text)
    assert honoured and honoured.group(1) == honoured.group(2) and int(honoured.group(2)) >= 10
    # every multi-GPU pod on the bridged A6000 node got an NVLink pair: 80 GB/s estimated
    for line in text.splitlines():
        if line.startswith("train-") and "a6000-bridges" in line and line.split()[1] == "2":
            assert " 80.0 " in line, line
    assert "processes and sockets left behind: none" in text
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert set(Path("/tmp").glob("gpu-demo-*")) == before
