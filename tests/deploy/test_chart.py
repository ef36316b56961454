"""The Helm chart: lints clean, values reach the objects they configure, bad values fail with a clear message,
and with default values it installs the same pods as the kustomize manifests."""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest
import yaml

from extender.cli import serve
from extender.config import SETTINGS, ExtenderConfig
from tests.deploy.rendering import (
    CHART,
    CHART_VARIANTS,
    DEPLOY,
    MANIFESTS,
    ChartVariant,
    containers,
    find,
    kustomize_build,
    render_chart,
    render_chart_files,
    without_webhook,
)
from tests.deploy.schemas import supported_versions

VERSIONS = supported_versions()
WORKLOADS = ("DaemonSet", "Deployment")


@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_helm_lint_is_clean(variant: str, version: str) -> None:
    """Strict lint, which also flags APIs deprecated or removed in that Kubernetes version."""
    report = helm_python.lint(CHART, CHART_VARIANTS[variant].values, strict=True,
                              namespace=CHART_VARIANTS[variant].namespace, kube_version=f"v{version}")
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and serious == []


def test_custom_values_reach_their_objects() -> None:
    variant = CHART_VARIANTS["custom"]
    objects = render_chart(variant)
    values = variant.values
    cluster_scoped = ("ClusterRole", "ClusterRoleBinding", "Namespace", "MutatingWebhookConfiguration",
                      "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    namespaced = [o for o in objects if o["kind"] not in cluster_scoped]
    for obj in namespaced:
        expected = "kube-system" if obj["kind"] == "RoleBinding" and obj["metadata"]["name"].endswith(
            "auth-reader") else values["namespace"]["name"]
        assert obj["metadata"]["namespace"] == expected, obj["metadata"]["name"]
    assert all(o["metadata"]["name"].startswith("prod-gpu-topology-") for o in objects if o["kind"] != "Namespace")

    (daemonset,) = find(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    plugin = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == values["plugin"]["nodeSelector"]
    assert pod["tolerations"] == values["plugin"]["tolerations"]
    assert plugin["image"] == "registry.acme.example/gpu-topology-plugin:0.1.0-rc1", "image.tag, no tag of its own"
    assert plugin["imagePullPolicy"] == "Always"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(any(e["key"] == "topo.acme.example/device-plugin" for e in t["matchExpressions"]) for t in terms)

    (deployment,) = find(without_webhook(objects), "Deployment")
    assert deployment["spec"]["replicas"] == 3
    images = {c["name"]: c["image"] for _, c in containers(deployment)}
    assert images == {"kube-scheduler": "registry.k8s.io/kube-scheduler:v1.35.4",
                      "extender": "registry.acme.example/gpu-topology-extender:0.1.0-rc2"}
    extender = next(c for _, c in containers(deployment) if c["name"] == "extender")
    assert extender["imagePullPolicy"] == "Always"
    assert "--reservation-timeout=120" in extender["args"] and "--metrics-port=18889" in extender["args"]
    assert extender["ports"] == [{"name": "http-metrics", "containerPort": 18889, "protocol": "TCP"}]
    (service,) = find(objects, "Service", "prod-gpu-topology-scheduler-metrics")
    assert {"name": "http-metrics", "port": 18889, "targetPort": "http-metrics", "protocol": "TCP"} in \
        service["spec"]["ports"]
    (pdb,) = find(without_webhook(objects), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2
    for policy in find(without_webhook(objects), "NetworkPolicy"):
        if not policy["spec"]["ingress"]:  # the uninstall hook's Job: no ingress at all
            continue
        assert policy["spec"]["ingress"][0]["from"] == values["networkPolicy"]["metricsFrom"]


def test_default_scheduler_mode_runs_no_scheduler_and_leader_elected_https_extenders() -> None:
    objects = render_chart(CHART_VARIANTS["default-scheduler"])
    (deployment,) = find(objects, "Deployment")
    assert [c["name"] for _, c in containers(deployment)] == ["extender"]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert find(objects, "ConfigMap") == []
    assert [p["metadata"]["name"] for p in find(objects, "PodDisruptionBudget")] == ["gpu-topology-extender"]
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "gpu-extender-tls", "defaultMode": 0o440}} in volumes


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "unknown mode": ({"scheduler": {"mode": "both"}}, "/scheduler/mode"),
    "list strategy": ({"plugin": {"deviceListStrategy": "volume-mounts"}}, "/plugin/deviceListStrategy"),
    "id strategy": ({"plugin": {"deviceIdStrategy": "serial"}}, "/plugin/deviceIdStrategy"),
    "kubernetes.io resource": ({"resourceName": "kubernetes.io/gpu"}, "/resourceName"),
    "prefix with slash": ({"annotationPrefix": "gpu-topology.io/x"}, "/annotationPrefix"),
    "zero weight": ({"scheduler": {"weight": 0}}, "/scheduler/weight"),
    "timeout without unit": ({"scheduler": {"httpTimeout": "5"}}, "/scheduler/httpTimeout"),
    "typo": ({"scheduler": {"replica": 3}}, "replica"),
    "racing schedulers": ({"scheduler": {"leaderElection": {"enabled": False}}}, "leaderElection.enabled=true"),
    "undrainable": ({"scheduler": {"podDisruptionBudget": {"minAvailable": 2}}}, "minAvailable must be below"),
    "metrics on the API port": ({"scheduler": {"extenderMetricsPort": 8888}}, "extenderMetricsPort must differ"),
    "top-level typo": ({"imagePullSecret": [{"name": "x"}]}, "imagePullSecret"),
    "pull secret as a string": ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0"),
    "selector label in podLabels": ({"plugin": {"podLabels": {"app.kubernetes.io/instance": "x"}}},
                                    "podLabels may not set app.kubernetes.io/instance"),
    "numeric annotation": ({"scheduler": {"podAnnotations": {"a": 1}}}, "/scheduler/podAnnotations/a"),
    "env without a name": ({"plugin": {"extraEnv": [{"value": "x"}]}}, "/plugin/extraEnv/0"),
    "mount without a path": ({"extender": {"extraVolumeMounts": [{"name": "x"}]}}, "/extender/extraVolumeMounts/0"),
    "negative island penalty": ({"extender": {"islandPenalty": -1}}, "/extender/islandPenalty"),
    "fractional island spare": ({"extender": {"islandSpare": 1.5}}, "/extender/islandSpare"),
    "fail-on-init as a string": ({"plugin": {"failOnInitError": "yes"}}, "/plugin/failOnInitError"),
    "namespace created without a name": ({"namespace": {"create": True}}, "namespace.create needs namespace.name"),
    "namespace created as the release's": ({"namespace": {"create": True, "name": "gpu-topology"}},
                                           "namespace.create needs namespace.name"),
    "namespace not a DNS label": ({"namespace": {"name": "GPU_Topology"}}, "/namespace/name"),
    "scrape interval without unit": ({"serviceMonitor": {"interval": "30"}}, "/serviceMonitor/interval"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_fail_with_a_message_naming_them(case: str) -> None:
    values, named = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology", copy.deepcopy(values)))
    assert named in str(caught.value)


def _pod_essentials(workload: dict[str, Any]) -> dict[str, Any]:
    """The parts of a pod that decide what runs and how (labels and chart bookkeeping left out)."""
    pod = copy.deepcopy(workload["spec"]["template"]["spec"])
    pod.pop("affinity", None)  # selector labels differ (the chart adds the release); checked elsewhere
    return pod


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_chart_defaults_install_the_same_pods_as_kustomize(kind: str) -> None:
    """On a cluster of the version the kustomize manifests pin kube-scheduler to, the chart's defaults run the
    same pods."""
    (kustomize,) = find(kustomize_build(MANIFESTS), kind)
    kustomize_objects = kustomize_build(MANIFESTS)
    scheduler_tag = next(c["image"] for w in kustomize_objects for _, c in containers(w)
                         if c["name"] == "kube-scheduler").rsplit(":", 1)[1]
    (chart,) = find(without_webhook(render_chart(CHART_VARIANTS["defaults"], scheduler_tag)), kind)
    assert chart["metadata"]["name"] == kustomize["metadata"]["name"]
    assert chart["spec"].get("replicas") == kustomize["spec"].get("replicas")
    assert _pod_essentials(chart) == _pod_essentials(kustomize)
    if kind == "DaemonSet":
        assert chart["spec"]["template"]["spec"]["affinity"] == kustomize["spec"]["template"]["spec"]["affinity"]


def test_notes_tell_how_to_opt_in_and_check() -> None:
    notes = render_chart_files(CHART_VARIANTS["custom"])["gpu-topology/templates/NOTES.txt"]
    assert "schedulerName: topology-aware" in notes
    assert "acme.example/gpu: 4" in notes
    assert "topo.acme.example/topology" in notes and "topo.acme.example/plan" in notes


# ---------------------------------------------------------------------------------------------------------------
# one test per value a platform team relies on (the NVIDIA device plugin chart's set)


def _pods(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload."""
    return [(w, w["spec"]["template"]) for w in objects if w["kind"] in WORKLOADS]


def _container(objects: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, container) of the one container called `name`."""
    (found,) = [(pod, c) for w in objects if w["kind"] in WORKLOADS for pod, c in containers(w) if c["name"] == name]
    return found


@pytest.mark.parametrize("variant", ["custom", "default-scheduler"])
def test_image_pull_secrets_reach_every_pod(variant: str) -> None:
    values = copy.deepcopy(CHART_VARIANTS[variant].values)
    values["imagePullSecrets"] = [{"name": "acme-registry"}]
    pods = _pods(render_chart(ChartVariant("r", "ns", values)))
    assert pods and all(t["spec"]["imagePullSecrets"] == [{"name": "acme-registry"}] for _, t in pods)
    assert all("imagePullSecrets" not in t["spec"] for _, t in _pods(render_chart(CHART_VARIANTS["defaults"])))


def test_pod_annotations_and_labels_are_added_and_selectors_kept() -> None:
    values = CHART_VARIANTS["custom"].values
    for workload, template in _pods(without_webhook(render_chart(CHART_VARIANTS["custom"]))):
        own = values["plugin"] if workload["kind"] == "DaemonSet" else values["scheduler"]
        assert own["podAnnotations"].items() <= template["metadata"]["annotations"].items()
        assert own["podLabels"].items() <= template["metadata"]["labels"].items()
        assert workload["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    # The standalone extender (default-scheduler mode) takes the scheduler side's pod metadata.
    variant = ChartVariant("r", "ns", {"scheduler": {"mode": "default-scheduler", "podAnnotations": {"a": "b"},
                                                      "podLabels": {"team": "ml"}}})
    (deployment,) = find(render_chart(variant), "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml"


def test_priority_class_names_are_set_or_left_out() -> None:
    custom = render_chart(CHART_VARIANTS["custom"])
    assert _container(custom, "plugin")[0]["priorityClassName"] == "acme-node-critical"
    assert "priorityClassName" not in _container(custom, "extender")[0], "scheduler.priorityClassName: empty"
    defaults = render_chart(CHART_VARIANTS["defaults"])
    assert _container(defaults, "plugin")[0]["priorityClassName"] == "system-node-critical"
    assert _container(defaults, "extender")[0]["priorityClassName"] == "system-cluster-critical"


@pytest.mark.parametrize("variant", ["custom", "default-scheduler"])
def test_extra_env_volumes_and_mounts(variant: str) -> None:
    values = copy.deepcopy(CHART_VARIANTS["custom"].values)
    values["scheduler"]["mode"] = "second-scheduler" if variant == "custom" else "default-scheduler"
    objects = render_chart(ChartVariant("prod", "gpu-system", values))
    for name in ("plugin", "extender"):
        extra = values[name]
        pod, container = _container(objects, name)
        env = container["env"]
        assert env[-len(extra["extraEnv"]):] == extra["extraEnv"], "extra env comes after the chart's own"
        assert container["volumeMounts"][-1:] == extra["extraVolumeMounts"]
        assert pod["volumes"][-1:] == extra["extraVolumes"]
        mounted = {m["name"] for m in container["volumeMounts"]}
        assert {v["name"] for v in pod["volumes"]} >= mounted, "every mount has its volume"
    _, scheduler = _container(objects, "kube-scheduler") if variant == "custom" else (None, {"volumeMounts": []})
    assert all(m["name"] != "scratch" for m in scheduler["volumeMounts"]), "extender mounts stay in its container"


def test_optional_namespace_holds_every_object_with_the_pod_security_level_the_plugin_needs() -> None:
    objects = render_chart(CHART_VARIANTS["custom"])
    (namespace,) = find(objects, "Namespace")
    assert namespace["metadata"]["name"] == "gpu-topology-prod"
    base = yaml.safe_load((MANIFESTS / "base" / "namespace.yaml").read_text())["metadata"]["labels"]
    security = {k: v for k, v in base.items() if k.startswith("pod-security.kubernetes.io/")}
    assert security and security.items() <= namespace["metadata"]["labels"].items()
    assert find(render_chart(CHART_VARIANTS["defaults"]), "Namespace") == []
    # namespace.name alone moves the objects without creating it.
    moved = render_chart(ChartVariant("r", "default", {"namespace": {"name": "gpu"}}))
    assert find(moved, "Namespace") == []
    assert {o["metadata"].get("namespace") for o in moved} - {None, "kube-system"} == {"gpu"}


def test_extender_placement_knobs_and_the_greedy_preset() -> None:
    def settings(values: dict[str, Any]) -> ExtenderConfig:
        """The extender's settings as its container's arguments resolve them (no environment, no file)."""
        _, container = _container(render_chart(ChartVariant("r", "ns", values)), "extender")
        flags = dict(serve.make_context("serve", container["args"][1:]).params)
        flags.pop("config_file"), flags.pop("print_config")
        return SETTINGS.load(flags, env={})

    defaults, model = settings({}), ExtenderConfig()
    assert (defaults.island_penalty, defaults.island_spare) == (model.island_penalty, model.island_spare), \
        "the chart's defaults are the extender's"
    tuned = settings({"extender": {"islandPenalty": 0.5, "islandSpare": 2}})
    assert (tuned.island_penalty, tuned.island_spare) == (0.5, 2)
    greedy = settings(yaml.safe_load((DEPLOY / "helm" / "presets" / "greedy.yaml").read_text()))
    assert greedy.island_penalty == 0.0 and greedy.island_spare == model.island_spare


@pytest.mark.parametrize(("value", "expected"), [(None, "true"), (True, "true"), (False, "false")])
def test_fail_on_init_error_reaches_the_plugin(value: bool | None, expected: str) -> None:
    """Exit (true, the default, as NVIDIA's chart) or keep running without GPUs when NVML is absent; the plugin reads
    GPUPLUGIN_FAIL_ON_INIT_ERROR as --fail-on-init-error (tests/deploy/test_cli_flags.py checks it resolves)."""
    values = {} if value is None else {"plugin": {"failOnInitError": value}}
    _, plugin = _container(render_chart(ChartVariant("r", "ns", values)), "plugin")
    assert {"name": "GPUPLUGIN_FAIL_ON_INIT_ERROR", "value": expected} in plugin["env"]


def test_service_monitors_select_the_metrics_services_and_ports() -> None:
    """Each ServiceMonitor (monitoring.coreos.com/v1) selects exactly one Service of the release in its namespace,
    by the labels that Service carries, and scrapes a port that Service names."""
    values = CHART_VARIANTS["custom"].values
    objects = render_chart(CHART_VARIANTS["custom"])
    monitors = find(objects, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"prod-gpu-topology-plugin", "prod-gpu-topology-extender",
                                                         "prod-gpu-topology-webhook"}
    services = find(objects, "Service")
    for monitor in monitors:
        spec = monitor["spec"]
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert values["serviceMonitor"]["labels"].items() <= monitor["metadata"]["labels"].items()
        selected = [s for s in services if s["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
                    and spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{monitor['metadata']['name']} selects {[s['metadata']['name'] for s in selected]}"
        ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
            assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "5s")
    assert find(render_chart(CHART_VARIANTS["defaults"]), "ServiceMonitor") == []
    # default-scheduler mode: the plugin and every standalone extender replica's metrics listener (plain HTTP).
    standalone = render_chart(ChartVariant("r", "ns", {"scheduler": {"mode": "default-scheduler"},
                                                       "serviceMonitor": {"enabled": True}}))
    monitors = find(standalone, "ServiceMonitor")
    assert [m["metadata"]["name"] for m in monitors] == ["r-gpu-topology-plugin", "r-gpu-topology-extender"]
    services = find(standalone, "Service")
    for monitor in monitors:
        selected = [s for s in services
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(selected) == 1, [s["metadata"]["name"] for s in selected]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in selected[0]["spec"]["ports"]}
    (extender_monitor,) = [m for m in monitors if m["metadata"]["name"] == "r-gpu-topology-extender"]
    (metrics,) = [s for s in services if extender_monitor["spec"]["selector"]["matchLabels"].items()
                  <= s["metadata"]["labels"].items()]
    assert metrics["metadata"]["name"] == "r-gpu-topology-extender-metrics"
    assert not any(k.endswith("/extender-role") for k in metrics["spec"]["selector"]), "every replica, not the leader"
