"""The KubeSchedulerConfiguration in every form deploy/ ships agrees with the extender API reference facts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import scheduler_config
from tests.deploy.rendering import (
    CHART_VARIANTS,
    MANIFESTS,
    SCHEDULER_DIR,
    find,
    kustomize_build,
    render_chart,
)

STANDALONE_FILE = SCHEDULER_DIR / "gpu-topology-scheduler-config.yaml"
DEFAULT_SCHEDULER_SNIPPET = SCHEDULER_DIR / "default-scheduler-extender.yaml"


def _args(container: dict[str, Any]) -> dict[str, str]:
    """--flag=value arguments of a container (command and args) as a dict."""
    out: dict[str, str] = {}
    for arg in [*container.get("command", []), *container.get("args", [])]:
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            out[key] = value
    return out


def _second_scheduler(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(parsed KubeSchedulerConfiguration, scheduler Deployment, its ConfigMap) of one rendering."""
    deployment = next(d for d in find(objects, "Deployment")
                      if any(c["name"] == "kube-scheduler" for c in d["spec"]["template"]["spec"]["containers"]))
    pod = deployment["spec"]["template"]["spec"]
    scheduler = next(c for c in pod["containers"] if c["name"] == "kube-scheduler")
    config_path = Path(_args(scheduler)["config"])
    mount = next(m for m in scheduler["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = find(objects, "ConfigMap", volume["configMap"]["name"])[0]
    relative = str(config_path.relative_to(mount["mountPath"]))
    key = next((i["key"] for i in volume["configMap"].get("items", []) if i["path"] == relative), relative)
    assert configmap["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    return yaml.safe_load(configmap["data"][key]), deployment, configmap


def _check_wiring(config: dict[str, Any], deployment: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    """The configuration points at the sidecar's port and at a Lease the scheduler may hold."""
    pod = deployment["spec"]["template"]["spec"]
    extender = next(c for c in pod["containers"] if c["name"] == "extender")
    args = _args(extender)
    assert args["host"] == "127.0.0.1", "the sidecar must not listen on the pod network"
    assert config["extenders"][0]["urlPrefix"].rstrip("/") == f"http://127.0.0.1:{args['port']}"
    election = config["leaderElection"]
    if deployment["spec"]["replicas"] > 1:
        assert election["leaderElect"] is True, "several replicas need leader election"
    if election["leaderElect"]:
        assert election["resourceNamespace"] == deployment["metadata"]["namespace"]
        lease_rules = [r for role in find(objects, "Role") for r in role["rules"]
                       if "leases" in r["resources"] and role["metadata"]["namespace"] == election["resourceNamespace"]]
        named = {n for r in lease_rules if "update" in r["verbs"] for n in r.get("resourceNames", [])}
        assert election["resourceName"] in named, "the lease Role must grant the Lease the configuration names"


def test_standalone_file_satisfies_the_reference() -> None:
    config = yaml.safe_load(STANDALONE_FILE.read_text())
    assert scheduler_config.problems(config, resource_name="nvidia.com/gpu",
                                     scheduler_name="gpu-topology-scheduler") == []


def test_kustomize_configmap_is_the_standalone_file_and_is_wired() -> None:
    objects = kustomize_build(MANIFESTS)
    config, deployment, _ = _second_scheduler(objects)
    assert config == yaml.safe_load(STANDALONE_FILE.read_text())
    assert config["leaderElection"]["resourceName"] == "gpu-topology-scheduler"
    _check_wiring(config, deployment, objects)


@pytest.mark.parametrize("variant", [n for n, v in CHART_VARIANTS.items()
                                     if v.values.get("scheduler", {}).get("mode", "second-scheduler")
                                     == "second-scheduler"])
def test_chart_configuration_satisfies_the_reference(variant: str) -> None:
    spec = CHART_VARIANTS[variant]
    objects = render_chart(spec)
    config, deployment, _ = _second_scheduler(objects)
    sched = spec.values.get("scheduler", {})
    resource = spec.values.get("resourceName", "nvidia.com/gpu")
    name = sched.get("schedulerName", "gpu-topology-scheduler")
    node_cache = sched.get("nodeCacheCapable", True)
    assert scheduler_config.problems(config, resource_name=resource, scheduler_name=name,
                                     node_cache_capable=node_cache) == []
    ext = config["extenders"][0]
    extender_args = next(c["args"] for c in deployment["spec"]["template"]["spec"]["containers"]
                         if c["name"] == "extender")
    if sched.get("filterBest", True):  # one call per pod: the extender must then pass the best nodes only
        assert "prioritizeVerb" not in ext and "weight" not in ext and "--filter-best" in extender_args
    else:
        assert ext["weight"] == sched.get("weight", 5) and "--filter-best" not in extender_args
    assert ext["httpTimeout"] == sched.get("httpTimeout", "5s")
    _check_wiring(config, deployment, objects)


def test_chart_defaults_match_the_kustomize_configuration() -> None:
    """Installing with Helm or with kustomize gives the scheduler the same configuration."""
    chart_config, _, _ = _second_scheduler(render_chart(CHART_VARIANTS["defaults"]))
    kustomize_config, _, _ = _second_scheduler(kustomize_build(MANIFESTS))
    assert chart_config == kustomize_config


def test_default_scheduler_snippet_satisfies_the_reference() -> None:
    config = yaml.safe_load(DEFAULT_SCHEDULER_SNIPPET.read_text())
    assert scheduler_config.problems(config, resource_name="nvidia.com/gpu", scheduler_name="default-scheduler",
                                     own_scheduler=False) == []
    ext = config["extenders"][0]
    assert ext["enableHTTPS"] is True and ext["urlPrefix"].startswith("https://")
    assert {"caFile", "certFile", "keyFile", "serverName"} <= set(ext["tlsConfig"])


def test_default_scheduler_snippet_names_the_extender_service() -> None:
    """The serverName the scheduler verifies is the Service the HTTPS extender variant creates."""
    config = yaml.safe_load(DEFAULT_SCHEDULER_SNIPPET.read_text())
    server_name = config["extenders"][0]["tlsConfig"]["serverName"]
    services = find(kustomize_build(SCHEDULER_DIR), "Service")
    names = {f"{s['metadata']['name']}.{s['metadata']['namespace']}.svc" for s in services}
    assert server_name in names
    port = int(config["extenders"][0]["urlPrefix"].rsplit(":", 1)[1].rstrip("/"))
    assert any(p["port"] == port for s in services for p in s["spec"]["ports"])


BROKEN_CASES = {
    "two binders": lambda c: c["extenders"].append(copy.deepcopy(c["extenders"][0])),
    "zero weight": lambda c: c["extenders"][0].update(prioritizeVerb="prioritize", weight=0),
    "other prioritize verb": lambda c: c["extenders"][0].__setitem__("prioritizeVerb", "score"),
    "no bind verb": lambda c: c["extenders"][0].pop("bindVerb"),
    "no node cache": lambda c: c["extenders"][0].__setitem__("nodeCacheCapable", False),
    "other resource": lambda c: c["extenders"][0].__setitem__("managedResources", [{"name": "amd.com/gpu"}]),
    "typo": lambda c: c["extenders"][0].__setitem__("filterverb", "filter"),
    "beta api": lambda c: c.__setitem__("apiVersion", "kubescheduler.config.k8s.io/v1beta3"),
    "plain http off-host": lambda c: c["extenders"][0].__setitem__("urlPrefix", "http://gpu-extender:8888"),
    "bad timeout": lambda c: c["extenders"][0].__setitem__("httpTimeout", "5 seconds"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_CASES))
def test_checker_rejects_broken_configurations(case: str) -> None:
    config = yaml.safe_load(STANDALONE_FILE.read_text())
    BROKEN_CASES[case](config)
    assert scheduler_config.problems(config, resource_name="nvidia.com/gpu",
                                     scheduler_name="gpu-topology-scheduler")
