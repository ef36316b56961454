"""`gpuplugin node-template --gpu-label` as a user runs it (a real process): the cloud provider's GPU label, the one
the Cluster Autoscaler's GPULabel() names, declared in every format beside the plugin's own labels, so that CA
counts the group's nodes as GPU nodes, reads their GPU type, and treats a new node whose GPUs are not allocatable
yet as still starting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.nvml import HGX
from tests.helpers.paths import REPO

PCIE = REPO / "fixtures" / "topologies" / "pcie-8x-rtx5090-2socket-sglang23020.txt"  # no GPU model in it
MODEL = "NVIDIA-A100-SXM4-80GB"  # HGX's GPUs, as the plugin labels them (gpu-topology.io/gpu-model)
AWS_LABEL = "k8s.io/cluster-autoscaler/node-template/label/"
CAPI_LABELS = "capacity.cluster-autoscaler.kubernetes.io/labels="
RENAMED = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuplugin.cli", "node-template", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_aws_tags_carry_the_providers_gpu_label_valued_with_the_gpu_model() -> None:
    plain = run("--topology", HGX, "--format", "aws")
    out = run("--topology", HGX, "--format", "aws", "--gpu-label", "k8s.amazonaws.com/accelerator")
    assert out.returncode == 0, out.stderr
    added = set(out.stdout.splitlines()) - set(plain.stdout.splitlines())
    assert added == {f"{AWS_LABEL}k8s.amazonaws.com/accelerator={MODEL}"}
    assert set(plain.stdout.splitlines()) <= set(out.stdout.splitlines())
    assert out.stderr == ""


def test_capi_labels_carry_the_gpu_label_with_the_value_given() -> None:
    out = run("--topology", PCIE, "--format", "capi", "--gpu-label", "cluster-api/accelerator=rtx-5090")
    assert out.returncode == 0, out.stderr
    (labels,) = [line for line in out.stdout.splitlines() if line.startswith(CAPI_LABELS)]
    pairs = dict(p.split("=", 1) for p in labels.removeprefix(CAPI_LABELS).split(","))
    assert pairs["cluster-api/accelerator"] == "rtx-5090"
    assert pairs["gpu-topology.io/fabric"] == "pcie"


@pytest.mark.parametrize(("fmt", "expected"), [
    ("labels", "cloud.google.com/gke-accelerator=nvidia-a100-80gb"),
    ("kubelet", ",cloud.google.com/gke-accelerator=nvidia-a100-80gb"),
])
def test_labels_and_the_kubelet_flag_carry_it_so_new_nodes_register_with_it(fmt: str, expected: str) -> None:
    """The kubelet flag puts it on the node from registration: CA then counts a node whose GPUs are not yet
    allocatable as starting, not as a ready node with no room (reference/autoscaling.md 1.4, 1.5)."""
    out = run("--topology", HGX, "--format", fmt, "--gpu-label", "cloud.google.com/gke-accelerator=nvidia-a100-80gb")
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout


def test_a_group_advertising_no_gpu_resource_ca_knows_is_warned_about(tmp_path: Path) -> None:
    """renameByDefault: only nvidia.com/gpu.shared; with the GPU label CA would hold every such node not ready."""
    config = tmp_path / "renamed.yaml"
    config.write_text(RENAMED)
    out = run("--topology", HGX, "--format", "aws", "--sharing-config", config,
              "--gpu-label", "k8s.amazonaws.com/accelerator")
    assert out.returncode == 0, out.stderr
    assert f"{AWS_LABEL}k8s.amazonaws.com/accelerator={MODEL}" in out.stdout.splitlines()
    assert "not ready (ResourceUnready)" in out.stderr
    assert run("--topology", HGX, "--format", "aws", "--gpu-label", "k8s.amazonaws.com/accelerator").stderr == ""


@pytest.mark.parametrize(("args", "message"), [
    (["--topology", PCIE, "--gpu-label", "k8s.amazonaws.com/accelerator"],
     "give k8s.amazonaws.com/accelerator=VALUE"),
    (["--topology", HGX, "--gpu-label", "gpu-topology.io/fabric=x"], "one of the plugin's own labels"),
    (["--topology", HGX, "--gpu-label", "Bad_Domain/accelerator"], "is not a label key"),
    (["--topology", HGX, "--gpu-label", "k8s.amazonaws.com/accelerator=A100 80GB"], "is not a label value"),
    (["--topology", HGX, "--format", "kubelet", "--gpu-label", "node.k8s.io/accelerator=a100"], "NodeRestriction"),
], ids=["no value, no model", "our own label", "bad key", "bad value", "kubelet may not set it"])
def test_bad_gpu_labels_answer_one_line_and_exit_2(args: list[str | Path], message: str) -> None:
    out = run(*args)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr and "--gpu-label" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
