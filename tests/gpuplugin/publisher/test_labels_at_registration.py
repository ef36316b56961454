"""`gpuplugin node-template --format kubelet` prints the kubelet's `--node-labels`, so a new node carries the
plugin's topology labels from its registration on: they must be exactly the labels the publisher writes for the same
topology (the publisher then finds nothing to change), for every recorded topology in fixtures/topologies, and only
labels NodeRestriction lets a kubelet set (the real kube-apiserver's verdict: tests/integration/
test_labels_at_registration_real.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuplugin.cli import main
from gpuplugin.commands.node_template import kubelet_label_problem
from gpuplugin.publisher import NodePublisher
from gputopo.contract import Keys
from gputopo.core import CoreError
from gputopo.discovery.loader import load_topology_file
from tests.fakes.kubeapi import FakeKubeApi
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.paths import REPO

TOPOLOGIES = sorted((REPO / "fixtures" / "topologies").glob("*.txt"))


def parses(path: Path) -> bool:
    try:
        load_topology_file(path)
    except CoreError:
        return False
    return True


PARSED = [p for p in TOPOLOGIES if parses(p)]


def node_labels_flag(path: Path, *args: str) -> dict[str, str]:
    out = CliRunner().invoke(main, ["node-template", "--topology", str(path), "--format", "kubelet", *args])
    assert out.exit_code == 0, out.output
    (line,) = out.stdout.splitlines()
    flag, _, value = line.partition("=")
    assert flag == "--node-labels"
    return dict(item.split("=", 1) for item in value.split(","))


def published_labels(fake: FakeKubeApi, api: Any, path: Path, keys: Keys) -> dict[str, str]:
    fake.add_node(node_object())
    NodePublisher(api, NODE, keys, load_topology_file(path), None, lambda: [], lambda: []).publish_once()
    labels = (fake.node(NODE) or {})["metadata"].get("labels", {})
    return {k: v for k, v in labels.items() if keys.is_published_label(k)}


def test_most_recorded_topologies_parse() -> None:
    assert len(PARSED) >= len(TOPOLOGIES) - 3, [p.name for p in TOPOLOGIES if p not in PARSED]


@pytest.mark.parametrize("path", PARSED, ids=[p.stem for p in PARSED])
def test_the_kubelet_flag_carries_exactly_what_the_publisher_publishes(fake: FakeKubeApi, api: Any,
                                                                        path: Path) -> None:
    keys = Keys()
    assert node_labels_flag(path) == published_labels(fake, api, path, keys)


def test_with_a_custom_prefix_too(fake: FakeKubeApi, api: Any) -> None:
    keys = Keys("topo.acme.example")
    path = PARSED[0]
    assert node_labels_flag(path, "--annotation-prefix", keys.prefix) == published_labels(fake, api, path, keys)


def test_a_node_registered_with_them_is_left_as_it_is_by_the_publisher(fake: FakeKubeApi, api: Any) -> None:
    path = PARSED[0]
    fake.add_node({**node_object(), "metadata": {**node_object()["metadata"],
                                                 "labels": {"team": "ml", **node_labels_flag(path)}}})
    publisher = NodePublisher(api, NODE, Keys(), load_topology_file(path), None, lambda: [], lambda: [])
    publisher._observe(fake.node(NODE) or {})
    _, annotations, labels, _ = publisher._plan()
    assert labels == {}  # nothing to write: the first patch carries the annotations only
    assert set(annotations) == {Keys().topology, Keys().state}


@pytest.mark.parametrize(("key", "allowed"), [
    ("gpu-topology.io/fabric", True),
    ("topo.acme.example/gpu-count", True),
    ("node.kubernetes.io/instance-type", True),
    ("gpu.kubelet.kubernetes.io/fabric", True),
    ("gpu.kubernetes.io/fabric", False),
    ("kubernetes.io/fabric", False),
    ("gpu.k8s.io/fabric", False),
    ("node-restriction.kubernetes.io/fabric", False),
    ("x.node-restriction.kubernetes.io/fabric", False),
    ("notkubernetes.io/fabric", True),
])
def test_node_restriction_namespaces(key: str, allowed: bool) -> None:
    assert (kubelet_label_problem(key) is None) is allowed


def test_a_prefix_kubelets_may_not_use_is_refused() -> None:
    out = CliRunner().invoke(main, ["node-template", "--topology", str(PARSED[0]), "--format", "kubelet",
                                    "--annotation-prefix", "gpu.k8s.io"])
    assert out.exit_code == 2 and "gpu.k8s.io/fabric" in out.output
