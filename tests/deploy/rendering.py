"""Every set of Kubernetes objects deploy/ can produce, loaded offline.

No kustomize or kubectl binary exists here, so `kustomize_build` follows the `resources` lists itself. That is
exact for our kustomizations because they use nothing else (a test asserts it). The Helm chart is rendered by
helm-python-sdk (Helm v4's Go engine through libhelm_c), the same engine `helm template` uses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate.utils
import yaml

ROOT = Path(__file__).resolve().parents[2]
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
    # Every knob moved off its default, in another release and namespace.
    "custom": ChartVariant(
        "prod",
        "gpu-system",
        {
            "resourceName": "acme.example/gpu",
            "annotationPrefix": "topo.acme.example",
            "plugin": {
                "deviceListStrategy": "cdi-cri",
                "deviceIdStrategy": "index",
                "metricsPort": 9400,
                "runtimeClassName": "nvidia",
                "nodeSelector": {"acme.example/gpu-pool": "training"},
                "tolerations": [{"key": "acme.example/dedicated", "operator": "Equal", "value": "gpu",
                                 "effect": "NoSchedule"}],
                "image": {"repository": "registry.acme.example/gpu-topology/plugin", "tag": "0.1.0-rc1",
                          "pullPolicy": "Always"},
            },
            "extender": {"reservationTimeout": 120,
                         "image": {"repository": "registry.acme.example/gpu-topology/extender",
                                   "tag": "0.1.0-rc1"}},
            "scheduler": {
                "schedulerName": "topology-aware",
                "image": {"tag": "v1.35.4"},
                "replicas": 3,
                "weight": 10,
                "httpTimeout": "10s",
                "nodeCacheCapable": False,
                "extenderPort": 18888,
                "extenderMetricsPort": 18889,
                "leaderElection": {"resourceName": "topology-aware-leader"},
                "podDisruptionBudget": {"minAvailable": 2},
            },
            "networkPolicy": {"metricsFrom": [{"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        },
    ),
    # Wiring into the existing default scheduler: standalone HTTPS extender, no kube-scheduler of ours.
    "default-scheduler": ChartVariant("gpu-topology", "gpu-topology", {"scheduler": {"mode": "default-scheduler"}}),
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


def render_chart_files(variant: ChartVariant) -> dict[str, str]:
    """Template path -> rendered text, exactly as `helm template` would print it."""
    return _chart().render(values=variant.values, name=variant.release, namespace=variant.namespace,
                           is_install=True)


def render_chart(variant: ChartVariant) -> list[Obj]:
    objects: list[Obj] = []
    for path, text in sorted(render_chart_files(variant).items()):
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
    return sets


def newest_kubernetes_versions(count: int = 2) -> list[str]:
    """The newest `count` minor versions kubernetes-validate ships schemas for, e.g. ['1.36.0', '1.37.0']."""
    minors: dict[str, str] = {}
    for version in kubernetes_validate.utils.all_versions():
        minors[kubernetes_validate.utils.major_minor(version)] = version
    return list(minors.values())[-count:]


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
