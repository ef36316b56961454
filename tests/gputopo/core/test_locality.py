"""Node locality from labels: which key speaks for a level, where two nodes split, what crossing costs."""

from __future__ import annotations

import pytest

from gputopo.core.locality import DEFAULT_LEVELS, Level, Locality, LocalityError, parse_locality

GKE = {"cloud.google.com/gce-topology-block": "b1", "cloud.google.com/gce-topology-subblock": "sb1",
       "topology.kubernetes.io/zone": "us-central1-a"}
TOPOGRAPH = {"network.topology.nvidia.com/leaf": "s1", "network.topology.nvidia.com/spine": "s2",
             "network.topology.nvidia.com/core": "s3"}
TOPOGRAPH_V01 = {"network.topology.nvidia.com/block": "s1", "network.topology.nvidia.com/spine": "s2",
                 "network.topology.nvidia.com/datacenter": "s3"}
EKS = {"topology.k8s.aws/network-node-layer-1": "nn-1", "topology.k8s.aws/network-node-layer-2": "nn-2",
       "topology.k8s.aws/network-node-layer-3": "nn-3", "topology.kubernetes.io/zone": "us-east-1a"}


@pytest.mark.parametrize(
    ("labels", "place"),
    [
        (GKE, ("sb1", "b1", None, "us-central1-a")),
        (TOPOGRAPH, ("s1", "s2", "s3", None)),
        (TOPOGRAPH_V01, ("s1", "s2", "s3", None)),
        (EKS, ("nn-3", "nn-2", "nn-1", "us-east-1a")),
        ({}, (None, None, None, None)),
        (None, (None, None, None, None)),
        ({"topology.kubernetes.io/zone": 7}, (None, None, None, None)),  # not a string: no value
    ],
)
def test_default_levels_read_each_publishers_keys(labels, place) -> None:
    assert Locality().place(labels) == place


def test_first_key_of_a_level_wins() -> None:
    both = {"network.topology.nvidia.com/leaf": "new", "network.topology.nvidia.com/block": "old"}
    assert Locality().place(both)[0] == "new"


def test_split_is_the_outermost_differing_level_and_costs_every_level_inside_it() -> None:
    loc = parse_locality("rack=example.com/rack@0.5,spine=example.com/spine@0.25,zone=example.com/zone@0.1")
    same = ("r1", "s1", "z1")
    assert loc.split(same, same) == -1 and loc.factor(-1) == 1.0
    assert loc.split(same, ("r2", "s1", "z1")) == 0 and loc.factor(0) == 0.5
    assert loc.split(same, ("r2", "s2", "z1")) == 1 and loc.factor(1) == pytest.approx(0.125)
    # a rack name reused under another spine is another rack: the split is at the spine
    assert loc.split(same, ("r1", "s2", "z1")) == 1
    assert loc.split(same, ("r1", "s1", "z2")) == 2 and loc.factor(2) == pytest.approx(0.0125)


def test_unlabelled_nodes_share_a_flat_network() -> None:
    loc = Locality()
    assert loc.split(loc.place({}), loc.place({})) == -1


def test_where_names_the_domain_that_holds_a_job() -> None:
    loc = Locality()
    place = loc.place(GKE)
    assert loc.where(-1, place) == "rack sb1"
    assert loc.where(0, place) == "spine b1"
    assert loc.where(1, place) == "zone us-central1-a"  # core unlabelled on GKE: the next labelled level
    assert loc.where(3, place) == "the cluster"


def test_parse_defaults_factor_and_keeps_order() -> None:
    loc = parse_locality(" rack = a.io/rack | b.io/rack , zone=topology.kubernetes.io/zone@1 ")
    assert [(lv.name, lv.keys, lv.factor) for lv in loc.levels] == [
        ("rack", ("a.io/rack", "b.io/rack"), DEFAULT_LEVELS[0].factor),
        ("zone", ("topology.kubernetes.io/zone",), 1.0),
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("rack", "expected name=key"),
        ("rack=a.io/r@x", "not a number"),
        ("rack=a.io/r@0", r"factor must be in \(0, 1\]"),
        ("rack=a.io/r@1.5", r"factor must be in \(0, 1\]"),
        ("rack=a.io/r@nan", r"factor must be in \(0, 1\]"),
        ("rack=", "at least one label key"),
        ("rack=not a key", "is not a label key"),
        ("Rack=a.io/r", "level name"),
        ("rack=a.io/r,rack=b.io/r", "repeat"),
        (",".join(f"l{i}=a.io/k{i}" for i in range(9)), "1-8 locality levels"),
    ],
)
def test_bad_specifications_name_the_problem(spec, message) -> None:
    with pytest.raises(LocalityError, match=message):
        parse_locality(spec)


def test_level_refuses_a_boolean_factor() -> None:
    with pytest.raises(LocalityError, match="factor"):
        Level("rack", ("a.io/r",), True)
