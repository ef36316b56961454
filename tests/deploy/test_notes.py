"""What `helm install` prints (the chart's NOTES.txt) tells the truth about where the plugin runs and how pods reach
the topology-aware scheduler, for each combination of plugin.optIn, webhook.enabled and scheduler.mode: a user
follows these lines first, so an opt-in label left unnamed means a plugin that never starts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.deploy.rendering import ChartVariant, render_chart_files

NOTES = "gpu-topology/templates/NOTES.txt"
LABEL_COMMAND = "kubectl label node <node> {prefix}/device-plugin=enabled"


def _notes(values: dict[str, Any]) -> str:
    return render_chart_files(ChartVariant("gpu-topology", "gpu-topology", values))[NOTES]


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(("opt_in", "prefix"),
                         list(itertools.product([True, False], ["gpu-topology.io", "topo.acme.example"])))
def test_opt_in_names_the_label_command_only_when_nodes_must_be_labelled(opt_in: bool, prefix: str) -> None:
    notes = _notes({"plugin": {"optIn": opt_in}, "annotationPrefix": prefix})
    command = LABEL_COMMAND.format(prefix=prefix)
    if opt_in:
        assert command in notes
        assert "every GPU node" not in notes
    else:
        assert command not in notes
        assert f"except those labelled {prefix}/device-plugin=nvidia" in _one_line(notes)
    assert "one pod per GPU node" not in notes


def test_no_plugin_no_plugin_lines() -> None:
    notes = _notes({"plugin": {"enabled": False}})
    assert "device-plugin=enabled" not in notes and "Device plugin" not in notes


@pytest.mark.parametrize("webhook", [True, False])
def test_second_scheduler_says_who_sets_schedulerName(webhook: bool) -> None:
    notes = _one_line(_notes({"webhook": {"enabled": webhook}, "scheduler": {"schedulerName": "topo-sched"},
                              "resourceName": "acme.example/gpu"}))
    sets = "The admission webhook sets schedulerName: topo-sched on a new pod that asks for acme.example/gpu"
    if webhook:
        assert sets in notes
        assert "a pod uses this scheduler only when it names it itself" not in notes
        assert "Pods there: all but those labelled gpu-topology.io/webhook=disabled." in notes
    else:
        assert sets not in notes
        assert "webhook.enabled=false" in notes
        assert "schedulerName: topo-sched containers: - resources: limits: acme.example/gpu: 4" in notes
    assert "pods opt in with" not in notes


def test_webhook_opt_in_names_the_namespace_and_pod_labels() -> None:
    notes = _notes({"webhook": {"namespaces": "opt-in", "pods": "opt-in"}})
    assert "kubectl label namespace <namespace> gpu-topology.io/webhook=enabled" in notes
    assert "Pods there: only those labelled gpu-topology.io/webhook=enabled." in notes


@pytest.mark.parametrize("webhook", [True, False])
def test_default_scheduler_mode_names_no_schedulerName_and_no_webhook(webhook: bool) -> None:
    """The webhook is not rendered in default-scheduler mode, whatever webhook.enabled says."""
    notes = _one_line(_notes({"scheduler": {"mode": "default-scheduler"}, "webhook": {"enabled": webhook}}))
    assert "schedulerName:" not in notes and "admission webhook sets" not in notes
    assert "no webhook is installed and no pod changes its schedulerName" in notes
    assert "wire https://<ClusterIP of gpu-topology-extender>:8443" in notes
