"""A kubelet started with `gpuplugin node-template --format kubelet`'s `--node-labels` registers its Node with the
plugin's topology labels: the real kube-apiserver v1.36.2 with the NodeRestriction admission plugin
(tests/helpers/node_restriction.py) admits that registration from the kubelet's own identity, and judges every
label key exactly as `kubelet_label_problem` does (which is what makes node-template refuse a prefix a kubelet could
not use). The window this closes is measured by bench/label_window.py.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from gpuplugin.cli import main
from gpuplugin.commands.node_template import kubelet_label_problem
from gputopo.contract import DEFAULT_KEYS
from tests.helpers.controlplane import ControlPlane, skip_reason
from tests.helpers.node_restriction import node_restricted_control_plane, register_as_kubelet
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.timeout(240)]

TOPOLOGY = REPO / "fixtures" / "topologies" / "aws-p5.48xlarge.txt"
KEYS_TO_JUDGE = ["gpu-topology.io/fabric", "topo.acme.example/allreduce-gbps-8", "node.kubernetes.io/pool",
                 "gpu.kubelet.kubernetes.io/fabric", "gpu.kubernetes.io/fabric", "kubernetes.io/fabric",
                 "gpu.k8s.io/fabric", "node-restriction.kubernetes.io/fabric", "notkubernetes.io/fabric"]


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with node_restricted_control_plane() as plane:
        yield plane


def node_labels(*args: str) -> dict[str, str]:
    out = CliRunner().invoke(main, ["node-template", "--topology", str(TOPOLOGY), "--format", "kubelet", *args])
    assert out.exit_code == 0, out.output
    return dict(item.split("=", 1) for item in out.stdout.strip().removeprefix("--node-labels=").split(","))


def test_the_kubelet_registers_its_node_with_the_topology_labels(cp: ControlPlane) -> None:
    labels = node_labels()
    assert DEFAULT_KEYS.fabric_label in labels and DEFAULT_KEYS.allreduce_label(8) in labels
    r = register_as_kubelet(cp, "labelled-at-birth", labels)
    assert r.status_code == 201, r.text[:400]
    node = cp.request("GET", "/api/v1/nodes/labelled-at-birth")
    assert labels.items() <= node["metadata"]["labels"].items()


@pytest.mark.parametrize("key", KEYS_TO_JUDGE)
def test_node_template_judges_each_key_as_node_restriction_does(cp: ControlPlane, key: str) -> None:
    r = register_as_kubelet(cp, "judged", {key: "x"}, dry_run=True)
    assert r.status_code in (201, 403), r.text[:400]
    assert (r.status_code == 201) is (kubelet_label_problem(key) is None), r.text[:400]
