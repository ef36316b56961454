"""With dra.enabled the chart's scheduler asks the extender about every pod through a second, ignorable entry that
never binds, so that pods whose GPUs come through resource claims (no extended resource: managedResources never
matches them) reach the extender's DRA node ranking (extender.placement.dra); without it the configuration is the
one-entry configuration of every other variant."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy import scheduler_config
from tests.deploy.rendering import ChartVariant, find, render_chart


def _config(values: dict[str, Any]) -> dict[str, Any]:
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    cm = next(c for c in find(objects, "ConfigMap") if c["metadata"]["name"].endswith("-scheduler-config"))
    return yaml.safe_load(cm["data"]["scheduler-config.yaml"])  # type: ignore[no-any-return]


@pytest.mark.parametrize("filter_best", [True, False])
def test_dra_adds_a_second_ignorable_entry_that_never_binds(filter_best: bool) -> None:
    config = _config({"dra": {"enabled": True}, "scheduler": {"filterBest": filter_best}})
    assert scheduler_config.problems(config, resource_name="nvidia.com/gpu",
                                     scheduler_name="gpu-topology-scheduler") == []
    main, dra = config["extenders"]
    assert dra["urlPrefix"] == main["urlPrefix"] and dra["ignorable"] is True
    assert "managedResources" not in dra and "bindVerb" not in dra and "preemptVerb" not in dra
    assert ("prioritizeVerb" in dra) is (not filter_best)


def test_without_dra_one_entry() -> None:
    assert len(_config({})["extenders"]) == 1


@pytest.mark.parametrize("case", ["binds", "not ignorable", "other url", "manages a resource"])
def test_checker_rejects_a_broken_dra_entry(case: str) -> None:
    config = _config({"dra": {"enabled": True}})
    dra = config["extenders"][1]
    {"binds": lambda: dra.__setitem__("bindVerb", "bind"),
     "not ignorable": lambda: dra.__setitem__("ignorable", False),
     "other url": lambda: dra.__setitem__("urlPrefix", "http://127.0.0.1:9999"),
     "manages a resource": lambda: dra.__setitem__("managedResources", [{"name": "nvidia.com/gpu"}])}[case]()
    assert scheduler_config.problems(config, resource_name="nvidia.com/gpu",
                                     scheduler_name="gpu-topology-scheduler")
