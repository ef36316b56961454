"""`gpuplugin node-template` as a user runs it (a real process): what a node-group template declares for scale from
zero, in each format, matching what the plugin publishes and advertises on a real node."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from gputopo.core import best_possible_gbps, nvlink_ring_sizes
from gputopo.discovery.loader import load_topology_file
from tests.fixtures.nvml import HGX, RECORDINGS
from tests.helpers.paths import REPO

PREFIX = "gpu-topology.io"
PCIE = REPO / "fixtures" / "topologies" / "pcie-8x-rtx5090-2socket-sglang23020.txt"
MIG_MIXED = RECORDINGS / "synthetic-hgx-h200-141gb-8gpu-mig-mixed.json"
MIG_SINGLE = RECORDINGS / "synthetic-hgx-a100-80gb-8gpu-mig-single.json"
AWS_LABEL = "k8s.io/cluster-autoscaler/node-template/label/"
AWS_RESOURCE = "k8s.io/cluster-autoscaler/node-template/resources/"
CAPI = "capacity.cluster-autoscaler.kubernetes.io/"


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuplugin.cli", "node-template", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def pairs(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    assert all("=" in line for line in lines), stdout
    out = dict(line.split("=", 1) for line in lines)
    assert len(out) == len(lines), "a key printed twice"
    return out


def expected_labels(path: Path) -> dict[str, str]:
    topology = load_topology_file(path)
    return {f"{PREFIX}/fabric": topology.fabric, f"{PREFIX}/gpu-count": str(topology.size),
            **{f"{PREFIX}/allreduce-gbps-{k}": str(math.floor(best_possible_gbps(topology, k)))
               for k in range(2, topology.size + 1)},
            **({f"{PREFIX}/nvlink-ring-{k}": "true" if k in nvlink_ring_sizes(topology) else "false"
                for k in range(2, topology.size + 1)} if topology.fabric != "pcie" else {})}


@pytest.mark.parametrize("path", [HGX, PCIE], ids=["nvswitch", "pcie"])
def test_labels_are_the_publishers(path: Path) -> None:
    out = run("--topology", path, "--format", "labels")
    assert out.returncode == 0, out.stderr
    got = pairs(out.stdout)
    model = got.pop(f"{PREFIX}/gpu-model", None)
    assert got == expected_labels(path)
    if path == HGX:
        assert model == "NVIDIA-A100-SXM4-80GB"


def test_aws_tags_declare_labels_and_resources() -> None:
    out = run("--topology", PCIE, "--format", "aws")
    assert out.returncode == 0, out.stderr
    tags = pairs(out.stdout)
    labels = {k.removeprefix(AWS_LABEL): v for k, v in tags.items() if k.startswith(AWS_LABEL)}
    resources = {k.removeprefix(AWS_RESOURCE): v for k, v in tags.items() if k.startswith(AWS_RESOURCE)}
    assert len(labels) + len(resources) == len(tags)
    assert labels == expected_labels(PCIE)
    assert resources == {"nvidia.com/gpu": "8"}


def test_shared_replicas_are_declared_with_their_counts(tmp_path: Path) -> None:
    config = tmp_path / "sharing.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                      "    - name: nvidia.com/gpu\n      replicas: 4\n      devices: [0, 1]\n")
    out = run("--topology", HGX, "--format", "aws", "--sharing-config", config)
    assert out.returncode == 0, out.stderr
    resources = {k.removeprefix(AWS_RESOURCE): v for k, v in pairs(out.stdout).items() if k.startswith(AWS_RESOURCE)}
    assert resources == {"nvidia.com/gpu": "6", "nvidia.com/gpu.shared": "8"}


@pytest.mark.parametrize("flag", [True, False, None], ids=["set", "false", "default"])
def test_failrequestsgreaterthanone_is_printed_as_the_plugins_label(tmp_path: Path, flag: bool | None) -> None:
    """A group scaled from zero is judged on its template alone: it must carry the label the plugin would publish,
    or a pod asking two replicas in one container reads as fitting a node that will refuse it."""
    config = tmp_path / "sharing.yaml"
    line = "" if flag is None else f"    failRequestsGreaterThanOne: {str(flag).lower()}\n"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n" + line +
                      "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    out = run("--topology", HGX, "--format", "labels", "--sharing-config", config)
    assert out.returncode == 0, out.stderr
    labels = pairs(out.stdout)
    assert labels[f"{PREFIX}/free-gpus.gpu.shared"] == "8"
    key = f"{PREFIX}/one-replica-per-container.gpu.shared"
    if flag:
        assert labels[key] == "true"
    else:  # time-slicing's default is false
        assert key not in labels


def test_capi_annotations_name_one_gpu_resource_and_say_what_is_left_out() -> None:
    out = run("--topology", MIG_MIXED, "--format", "capi", "--mig-strategy", "mixed")
    assert out.returncode == 0, out.stderr
    ann = pairs(out.stdout)
    assert set(ann) == {f"{CAPI}labels", f"{CAPI}gpu-type", f"{CAPI}gpu-count"}
    labels = dict(item.split("=", 1) for item in ann[f"{CAPI}labels"].split(","))
    assert labels[f"{PREFIX}/gpu-count"] == "4"  # the whole GPUs; the other 4 are MIG
    assert sorted(k for k in labels if "allreduce" in k) == [f"{PREFIX}/allreduce-gbps-{k}" for k in (2, 3, 4)]
    assert (ann[f"{CAPI}gpu-type"], ann[f"{CAPI}gpu-count"]) == ("nvidia.com/gpu", "4")
    assert "nvidia.com/mig-1g.18gb=4" in out.stderr and "not declared" in out.stderr


def test_mig_resources_are_counted_per_strategy() -> None:
    mixed = run("--topology", MIG_MIXED, "--format", "aws", "--mig-strategy", "mixed")
    assert mixed.returncode == 0, mixed.stderr
    resources = {k.removeprefix(AWS_RESOURCE): v for k, v in pairs(mixed.stdout).items() if k.startswith(AWS_RESOURCE)}
    assert resources == {"nvidia.com/gpu": "4", "nvidia.com/mig-1g.18gb": "4", "nvidia.com/mig-2g.35gb": "2",
                         "nvidia.com/mig-3g.71gb": "3", "nvidia.com/mig-4g.71gb": "1", "nvidia.com/mig-7g.141gb": "1"}
    single = run("--topology", MIG_SINGLE, "--format", "aws", "--mig-strategy", "single")
    assert single.returncode == 0, single.stderr
    assert pairs(single.stdout) == {f"{AWS_RESOURCE}nvidia.com/gpu": "56"}  # 8 GPUs x 7 instances; no whole GPU


@pytest.mark.parametrize(("args", "message"), [
    (["--topology", "{bad}"], "row header"),
    (["--topology", "{missing}"], "cannot read file"),
    (["--topology", str(PCIE), "--mig-strategy", "mixed"], "needs MIG GPUs"),
    (["--topology", str(MIG_MIXED), "--mig-strategy", "single"], "single MIG strategy needs every GPU"),
    (["--topology", str(PCIE), "--resource-name", "gpu"], "--resource-name"),
])
def test_bad_input_answers_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "topology.txt"
    bad.write_text("this is not a topology\n")
    args = [a.format(bad=bad, missing=tmp_path / "nope.txt") for a in args]
    out = run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], out.stderr


def test_there_is_no_karpenter_format_until_the_reference_spells_it() -> None:
    out = run("--topology", PCIE, "--format", "karpenter")
    assert out.returncode == 2 and "karpenter" in out.stderr
