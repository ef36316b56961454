"""`gpuplugin slices` as a user runs it: a real process, YAML that validates, clear errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.gpuplugin.dra.conftest import DGX1


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuplugin.cli", "slices", *args], capture_output=True, text=True,
                          timeout=60)


def test_prints_valid_slices_with_the_allocated_quads_gpus_last() -> None:
    out = run("--topology", str(DGX1), "--node-name", "gpu-node-1", "--allocated", "set-0-1-2-3", "--unhealthy", "7")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# 115 devices: 2 x 8 single GPUs, all 28 sets of 2, all 70 sets of 4")
    docs = list(yaml.safe_load_all(out.stdout))
    assert len(docs) == 4
    for doc in docs:
        kubernetes_validate.validate(doc, "1.36.0", strict=True)
        assert doc["metadata"]["generateName"].endswith("-gpu-topology.io-gpu-node-1-")
    for order in ("rings", "one"):
        singles = [d for d in docs[1]["spec"]["devices"] if d["attributes"].get("order") == {"string": order}]
        prefix = "gpu" if order == "rings" else "one"
        assert {d["name"] for d in singles[:3]} == {f"{prefix}-{g}" for g in (4, 5, 6)}  # 0-3 held, 7 unhealthy
        assert [d["name"] for d in singles if d.get("taints")] == [f"{prefix}-7"]


@pytest.mark.parametrize(("args", "message"), [
    (["--allocated", "set-0-1,set-1-2"], "share GPUs"),
    (["--allocated", "set-0-9"], "does not publish"),
    (["--unhealthy", "x"], "not a comma-separated list"),
    (["--set-sizes", "3,64"], "--set-sizes: set sizes must be within 2..16, got [64]"),
    (["--set-sizes", "2,x"], "not a comma-separated list"),
    (["--node-name", ""], "node-name is required"),
])
def test_bad_input_exits_2_naming_the_problem(args: list[str], message: str) -> None:
    base = {"--node-name": "n1"}
    argv = ["--topology", str(DGX1)]
    for key, value in base.items():
        if key not in args:
            argv += [key, value]
    out = run(*argv, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
