"""The README's first command, end to end: real plugin processes, kubelet simulators, the extender on uvicorn.

The demo runs with TMPDIR pointed at a directory this test owns, so what it leaves behind is checked there alone
(other demos may run on the same machine at the same time) and must be nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.paths import short_dir


def left_in(directory: Path) -> list[str]:
    """Every path under `directory`, relative to it: what a run that should clean up after itself left there."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


def test_the_leftover_check_names_whatever_a_run_leaves_in_its_temp_dir(tmp_path: Path) -> None:
    assert left_in(tmp_path) == []
    (tmp_path / "gpu-demo-x" / "dgx1-v100-a").mkdir(parents=True)
    (tmp_path / "gpu-demo-x" / "dgx1-v100-a" / "kubelet.sock").touch()
    (tmp_path / "stray.log").touch()
    assert left_in(tmp_path) == ["gpu-demo-x", "gpu-demo-x/dgx1-v100-a", "gpu-demo-x/dgx1-v100-a/kubelet.sock",
                                 "stray.log"]


def test_demo_places_pods_honours_plans_and_cleans_up(tmp_path: Path) -> None:
    out_dir, stdout, stderr = tmp_path / "out", tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    seen: set[str] = set()
    # short: the demo's unix sockets live under TMPDIR, and pytest's tmp_path is too deep for their 108 bytes
    with short_dir("demo-tmp-") as tmpdir, open(stdout, "w") as so, open(stderr, "w") as se:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuplugin.cli", "demo", "--pods", "14", "--out", str(out_dir)],
            stdout=so, stderr=se, text=True, env=dict(os.environ, TMPDIR=str(tmpdir)),
        )
        deadline = time.monotonic() + 240
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen.update(p.name for p in tmpdir.iterdir())
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        left = left_in(tmpdir)
    text = stdout.read_text()
    assert proc.returncode == 0, text[-3000:] + stderr.read_text()[-3000:]
    assert "cluster up: 5 nodes" in text
    assert re.search(r"\[14/14\] ", text)
    honoured = re.search(r"plans honoured by the plugin: (\d+)/(\d+)", text)
    assert honoured and honoured.group(1) == honoured.group(2) and int(honoured.group(2)) >= 10
    # every multi-GPU pod on the bridged A6000 node got an NVLink pair: 80 GB/s estimated
    for line in text.splitlines():
        if line.startswith("train-") and "a6000-bridges" in line and line.split()[1] == "2":
            assert " 80.0 " in line, line
    assert "processes and sockets left behind: none" in text
    assert (out_dir / "demo.png").stat().st_size > 10_000
    assert any(name.startswith("gpu-demo-") for name in seen), seen  # the demo worked in the TMPDIR it was given
    assert left == []
