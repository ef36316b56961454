"""`gpuplugin topo` and `gpuplugin plan` as a user runs them: real processes, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import SHARED

DGX1 = str(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuplugin.cli", *args], capture_output=True, text=True, input=stdin, timeout=60
    )


def test_topo_default_is_the_bundled_cube_mesh() -> None:
    out = run("topo")
    assert out.returncode == 0, out.stderr
    assert "bundled dgx1-v100-hybrid-cube-mesh.txt: 8 GPUs, fabric nvlink" in out.stdout
    assert "NVLink islands: {0,1,2,3,4,5,6,7}" in out.stdout
    row2 = next(line for line in out.stdout.splitlines() if line.strip().startswith("2  "))
    assert "40.0" in row2


def test_topo_reads_stdin_and_reports_partial_files_clearly() -> None:
    text = (SHARED / "topologies" / "aws-p5.48xlarge.txt").read_text()
    assert "fabric nvswitch" in run("topo", "-", stdin=text).stdout
    bad = run("topo", str(SHARED / "topologies" / "pcie-8gpu-2socket-pix-phb-k8s53497-PARTIAL.txt"))
    assert bad.returncode != 0
    assert "GPU5" in bad.stderr


def test_plan_json() -> None:
    out = run("plan", "--topology", DGX1, "--size", "2", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["gpus"] == [0, 3]
    assert doc["allreduce_gbps"] == 40.0
    assert doc["optimal"] is True


def test_plan_with_available_and_must_include_explains_itself() -> None:
    out = run("plan", "--topology", DGX1, "--size", "2", "--available", "4,5,6,7", "--must-include", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("GPUs 5,6")
    assert "NUMA nodes spanned" in out.stdout and "remainder quality" in out.stdout


def test_plan_errors_go_to_stderr_with_status_2() -> None:
    for args, message in [
        (("--size", "9"), "exceeds the 8 available"),
        (("--size", "2", "--available", "0,x"), "not a comma-separated list"),
        (("--size", "2", "--must-include", "3", "--available", "0,1"), "not available"),
    ]:
        out = run("plan", "--topology", DGX1, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr
        assert out.stdout == ""
    missing = run("plan", "--topology", "/nonexistent/topo.txt", "--size", "1")
    assert missing.returncode == 2
