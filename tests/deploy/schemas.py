"""Strict validation of deploy/'s objects against the Kubernetes OpenAPI schemas kubernetes-validate ships, for
every minor version the project claims: from the chart's kubeVersion floor to the newest schema shipped.
"""

from __future__ import annotations

import functools
import re

import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml

from tests.deploy.rendering import CHART, Obj

# kubernetes-validate re-reads and re-parses its multi-megabyte _definitions.json on every call (about 40 ms per
# object); the files never change, so each parsed file is kept (0.3 s instead of 4 s per version for all objects).
kv_utils.schema_contents = functools.cache(kv_utils.schema_contents)

# Kinds that are not part of the Kubernetes API: kustomize's and kube-scheduler's configuration files (tested in
# test_scheduler_config.py) and the Prometheus Operator's CRD (tests/deploy/test_chart.py checks its wiring).
NOT_KUBERNETES_API = {"Kustomization", "KubeSchedulerConfiguration", "ServiceMonitor"}


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = re.findall(r"\d+", version)
    return int(major), int(minor_)


def oldest_supported() -> tuple[int, int]:
    """The floor of Chart.yaml's kubeVersion (">=1.30.0-0" -> (1, 30)): the oldest Kubernetes the project claims."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.\d+(-0)?", constraint.strip())
    assert match, f"Chart.yaml kubeVersion {constraint!r} is not a plain lower bound"
    return int(match.group(1)), int(match.group(2))


def supported_versions() -> list[str]:
    """One version per minor, oldest claimed to newest shipped, e.g. ['1.30.0', ..., '1.37.0']."""
    minors: dict[tuple[int, int], str] = {}
    for version in kubernetes_validate.utils.all_versions():
        if minor(version) >= oldest_supported():
            minors[minor(version)] = version
    return [minors[m] for m in sorted(minors)]


def failures(objects: list[Obj], version: str) -> list[str]:
    """What the API server of `version` would reject, one line per problem (empty: all valid)."""
    found = []
    for obj in objects:
        if obj["kind"] in NOT_KUBERNETES_API:
            continue
        name = f"{obj['kind']}/{obj['metadata'].get('name')}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            found.append(f"{name}: {'.'.join(str(p) for p in e.path)}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            found.append(f"{name}: {e.message}")
    return found
