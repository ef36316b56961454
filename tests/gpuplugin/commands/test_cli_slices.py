"""`gpuplugin slices` as a user runs it: a real process, YAML that validates, clear errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from gpuplugin.dra.slices import MAX_NAME, parse_slice_index, slice_name
from gputopo.contract import dns_subdomain_problem
from tests.deploy.schemas import failures, minor, supported_versions
from tests.gpuplugin.dra.conftest import DGX1

# resource.k8s.io/v1 (and so a ResourceSlice with counters) is served from Kubernetes 1.34 on.
DRA_V1_VERSIONS = [v for v in supported_versions() if minor(v) >= (1, 34)]


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
    for order in ("rings", "one"):
        singles = [d for d in docs[1]["spec"]["devices"] if d["attributes"].get("order") == {"string": order}]
        prefix = "gpu" if order == "rings" else "one"
        assert {d["name"] for d in singles[:3]} == {f"{prefix}-{g}" for g in (4, 5, 6)}  # 0-3 held, 7 unhealthy
        assert [d["name"] for d in singles if d.get("taints")] == [f"{prefix}-7"]


def test_prints_slices_kubectl_apply_takes_for_every_dra_v1_version() -> None:
    """kubectl apply refuses generateName (issue 20, item 6): fixed names, one per slice, in index order, valid
    ResourceSlices for every supported Kubernetes that serves resource.k8s.io/v1; the same names for another state,
    so a second apply updates the slices in place."""
    assert DRA_V1_VERSIONS and DRA_V1_VERSIONS[0].startswith("1.34.")
    outputs = [run("--topology", str(DGX1), "--node-name", "gpu-node-1", *extra)
               for extra in ([], ["--allocated", "set-0-1-2-3,gpu-5"])]
    names = []
    for out in outputs:
        assert out.returncode == 0, out.stderr
        docs = list(yaml.safe_load_all(out.stdout))
        for version in DRA_V1_VERSIONS:
            assert failures(docs, version) == [], version
        assert all("generateName" not in d["metadata"] for d in docs)
        names.append([d["metadata"]["name"] for d in docs])
    assert names[0] == names[1] == sorted(names[0]) == [f"gpu-node-1-gpu-topology.io-{i:05x}" for i in range(4)]


_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True)
_SUBDOMAIN = st.lists(_LABEL, min_size=1, max_size=8).map(".".join).filter(lambda s: len(s) <= MAX_NAME)


@given(driver=_SUBDOMAIN.filter(lambda s: len(s) <= 63), node=_SUBDOMAIN, index=st.integers(0, 40))
@example(driver="d" * 63, node=".".join(["n" * 63] * 3 + ["m" * 61]), index=15)  # the longest: cut and hashed
@example(driver="gpu-topology.io", node="x" * 63 + "." + "x" * 173 + "." + "y" * 15, index=0)  # cut at a '.'
def test_slice_names_are_dns_subdomains_distinct_per_index_and_not_the_drivers(driver: str, node: str,
                                                                               index: int) -> None:
    name = slice_name(index, driver, node)
    assert dns_subdomain_problem(name) is None, name
    assert name == slice_name(index, driver, node) != slice_name(index + 1, driver, node)
    assert name < slice_name(index + 1, driver, node)  # the allocator reads a pool's slices in name order
    assert parse_slice_index(name, driver, node) is None  # a starting driver replaces slices applied by hand


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
