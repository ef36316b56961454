"""Every set of Kubernetes objects deploy/ can produce, loaded offline.

No kustomize or kubectl binary exists here, so `kustomize_build` follows the `resources` lists itself. That is
exact for our kustomizations because they use nothing else (a test asserts it). The Helm chart is rendered by
helm-python-sdk (Helm v4's Go engine through libhelm_c), the same engine `helm template` uses.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native as helm_native

from tests.helpers.paths import REPO as ROOT  # the deploy tests' name for it

DEPLOY = ROOT / "deploy"
MANIFESTS = DEPLOY / "manifests"
SCHEDULER_DIR = DEPLOY / "scheduler"
CHART = DEPLOY / "helm" / "gpu-topology"
KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources"}

Obj = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization uses something this loader does not emulate, or lists a missing file."""


def load_documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(directory: Path) -> Obj:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory} has no kustomization.yaml")
    data = yaml.safe_load(path.read_text())
    unknown = set(data) - KUSTOMIZE_KEYS
    if unknown:
        raise KustomizeError(f"{path}: keys {sorted(unknown)} are not emulated by tests/deploy/rendering.py")
    return data


def kustomize_files(directory: Path) -> list[Path]:
    """The manifest files a `kubectl apply -k directory` would apply, in order (directories recursed)."""
    files: list[Path] = []
    for entry in _kustomization(directory).get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            files.extend(kustomize_files(target))
        elif target.is_file():
            files.append(target)
        else:
            raise KustomizeError(f"{directory}/kustomization.yaml lists {entry!r}, which does not exist")
    return files


def kustomize_build(directory: Path) -> list[Obj]:
    return [doc for path in kustomize_files(directory) for doc in load_documents(path)]


@dataclass(frozen=True)
class ChartVariant:
    """One `helm template` invocation: release name, namespace and values."""

    release: str
    namespace: str
    values: Obj


CHART_VARIANTS: dict[str, ChartVariant] = {
    "defaults": ChartVariant("gpu-topology", "gpu-topology", {}),
    # Every knob moved off its default, in another release and namespace (created by the chart).
    "custom": ChartVariant(
        "prod",
        "gpu-system",
        {
            "resourceName": "acme.example/gpu",
            "annotationPrefix": "topo.acme.example",
            "image": {"tag": "0.1.0-rc1", "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "acme-registry"}],
            "namespace": {"name": "gpu-topology-prod", "create": True},
            "plugin": {
                "image": {"repository": "registry.acme.example/gpu-topology-plugin"},
                "deviceListStrategy": "cdi-cri",
                "deviceIdStrategy": "index",
                "migStrategy": "mixed",
                "metricsPort": 9400,
                "failOnInitError": False,
                "runtimeClassName": "nvidia",
                "priorityClassName": "acme-node-critical",
                "podAnnotations": {"acme.example/team": "ml-platform"},
                "podLabels": {"acme.example/cost-center": "gpu"},
                "nodeSelector": {"acme.example/gpu-pool": "training"},
                "tolerations": [{"key": "acme.example/dedicated", "operator": "Equal", "value": "gpu",
                                 "effect": "NoSchedule"}],
                "extraEnv": [{"name": "TZ", "value": "UTC"}],
                "extraVolumes": [{"name": "acme-ca", "configMap": {"name": "acme-ca"}}],
                "extraVolumeMounts": [{"name": "acme-ca", "mountPath": "/etc/acme-ca", "readOnly": True}],
            },
            "extender": {
                "image": {"repository": "registry.acme.example/gpu-topology-extender", "tag": "0.1.0-rc2"},
                "reservationTimeout": 120,
                "islandPenalty": 0.5,
                "islandSpare": 2,
                "locality": "rack=acme.example/rack@0.5,zone=topology.kubernetes.io/zone",
                "jobOwnerKinds": ["PyTorchJob", "MPIJob", "JobSet"],
                "extraEnv": [{"name": "TZ", "value": "UTC"}],
                "extraVolumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Mi"}}],
                "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            },
            "scheduler": {
                "schedulerName": "topology-aware",
                "image": {"tag": "v1.35.4"},
                "replicas": 3,
                "filterBest": False,  # two calls per pod: filter, then prioritize weighed against the in-tree scores
                "weight": 10,
                "httpTimeout": "10s",
                "nodeCacheCapable": False,
                "extenderPort": 18888,
                "extenderMetricsPort": 18889,
                "priorityClassName": "",
                "podAnnotations": {"acme.example/team": "ml-platform"},
                "podLabels": {"acme.example/cost-center": "scheduling"},
                "leaderElection": {"resourceName": "topology-aware-leader"},
                "podDisruptionBudget": {"minAvailable": 2},
            },
            "networkPolicy": {"metricsFrom": [{"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
            "serviceMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "5s",
                               "labels": {"release": "kube-prometheus-stack"}},
        },
    ),
    # Wiring into the existing default scheduler: standalone HTTPS extender, no kube-scheduler of ours.
    "default-scheduler": ChartVariant("gpu-topology", "gpu-topology", {"scheduler": {"mode": "default-scheduler"}}),
    # GPU sharing with MPS: the plugin's MPS volumes and the MPS control daemon set on the plugin's nodes.
    "sharing-mps": ChartVariant("gpu-topology", "gpu-topology", {"plugin": {
        "sharing": {"enabled": True, "configs": {"mps": "version: v1\nsharing:\n  mps:\n    resources:\n"
                                                        "    - {name: nvidia.com/gpu, replicas: 4}\n"}},
        "nodeSelector": {"acme.example/gpu-pool": "inference"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}),
    # A single scheduler replica without leader election, no PDB, no NetworkPolicies.
    "minimal": ChartVariant(
        "gpu-topology",
        "gpu-topology",
        {
            "scheduler": {"replicas": 1, "leaderElection": {"enabled": False},
                          "podDisruptionBudget": {"enabled": False}},
            "networkPolicy": {"enabled": False},
        },
    ),
}


@functools.cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_chart_files(variant: ChartVariant, kube_version: str | None = None) -> dict[str, str]:
    """Template path -> rendered text, exactly as `helm template [--kube-version v1.X.Y]` would print it.

    `kube_version` is what `.Capabilities.KubeVersion` holds (Helm's built-in default when None; the API server's
    version on a real install). helm-python-sdk 0.2.2's Chart.render does not pass it on, though its libhelm_c's
    render options take it (the option `helm template --kube-version` sets), so it goes through the same native call.
    """
    options = {"name": variant.release, "namespace": variant.namespace, "is_install": True}
    if kube_version is not None:
        options["kube_version"] = kube_version
    rendered = helm_native.call_string("helm_render", _chart()._raw(), json.dumps(variant.values),
                                       json.dumps(options))
    return dict(json.loads(rendered))


def install_dry_run(variant: ChartVariant, kube_version: str) -> str:
    """The manifest `helm install --dry-run=client --kube-version <v>` prints: unlike a plain render, an install checks
    Chart.yaml's kubeVersion against the cluster's (HelmReleaseError "chart requires kubeVersion: ..."). Through the
    native call, as helm-python-sdk 0.2.2's Config.install does not pass kube_version on."""
    config = helm_python.Config(namespace=variant.namespace)
    handle, ref = config._chart_args(_chart())
    options = {"namespace": variant.namespace, "dry_run": "client", "kube_version": kube_version}
    release = helm_native.call_string("helm_install", config._raw(), config._context_arg(None), handle, ref,
                                      variant.release, json.dumps(variant.values), json.dumps(options))
    return str(json.loads(release)["manifest"])


def render_chart(variant: ChartVariant, kube_version: str | None = None) -> list[Obj]:
    objects: list[Obj] = []
    for path, text in sorted(render_chart_files(variant, kube_version).items()):
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


@functools.cache
def all_renderings() -> dict[str, list[Obj]]:
    """Every object set deploy/ yields: the two kustomize entry points and each chart variant."""
    sets = {
        "kustomize:deploy/manifests": kustomize_build(MANIFESTS),
        "kustomize:deploy/scheduler": kustomize_build(SCHEDULER_DIR),
    }
    for name, variant in CHART_VARIANTS.items():
        sets[f"helm:{name}"] = render_chart(variant)
    assert sorted(sets) == rendering_names()
    return sets


def rendering_names() -> list[str]:
    """all_renderings()' keys, sorted, without rendering anything: parametrize ids are made at collection, and
    rendering every variant there made each collection of the suite (the standalone copy's too) seconds slower."""
    return sorted(["kustomize:deploy/manifests", "kustomize:deploy/scheduler", *(f"helm:{n}" for n in CHART_VARIANTS)])


def containers(obj: Obj) -> Iterator[tuple[Obj, Obj]]:
    """(pod spec, container) for every container (init containers too) of a workload object."""
    spec = obj.get("spec", {}).get("template", {}).get("spec")
    if spec is None:
        return
    for key in ("initContainers", "containers"):
        for container in spec.get(key, []):
            yield spec, container


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def component(obj: Obj) -> str | None:
    """The chart's app.kubernetes.io/component label of an object (plugin, scheduler, webhook, ...)."""
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def generated_masked(objects: list[Obj]) -> list[Obj]:
    """The objects with what Helm generates anew on every render (the webhook's certificates and CA bundle) masked,
    so two renderings compare equal when the chart itself did not change."""
    out = copy.deepcopy(objects)
    for obj in out:
        if obj["kind"] == "Secret" and component(obj) == "webhook":
            obj["data"] = {key: "<generated>" for key in obj.get("data", {})}
        for hook in obj.get("webhooks", []) if obj["kind"] == "MutatingWebhookConfiguration" else []:
            if "caBundle" in hook.get("clientConfig", {}):
                hook["clientConfig"]["caBundle"] = "<generated>"
    return out


def without_webhook(objects: list[Obj]) -> list[Obj]:
    """The objects of the scheduling path: the admission webhook's own are tested in test_webhook_deploy.py."""
    return [o for o in objects if component(o) != "webhook"]


def write_renderings(directory: Path) -> list[Path]:
    """One multi-document YAML file per rendering (for scanners such as checkov that want files)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in all_renderings().items():
        path = directory / (name.replace(":", "_").replace("/", "_") + ".yaml")
        path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
        written.append(path)
    return written


if __name__ == "__main__":
    import sys

    for written in write_renderings(Path(sys.argv[1])):
        print(written)


@functools.cache
def _scheduler_config_text(values_json: str) -> str:
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", json.loads(values_json)))
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scheduler-config")]
    return str(cm["data"]["scheduler-config.yaml"])


def chart_scheduler_config(values: Obj | None = None) -> Obj:
    """The KubeSchedulerConfiguration the chart renders (second-scheduler mode) with `values`: what sim.scheduler's
    driver takes to follow the deployed managedResources (e.g. {"webhook": {"wholeJobs": True}}: none listed)."""
    return dict(yaml.safe_load(_scheduler_config_text(json.dumps(values or {}, sort_keys=True))))
