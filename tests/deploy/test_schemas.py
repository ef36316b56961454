"""Every object deploy/ can produce validates against the Kubernetes OpenAPI schemas, offline and strictly."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.rendering import MANIFESTS, SCHEDULER_DIR, all_renderings, newest_kubernetes_versions

VERSIONS = newest_kubernetes_versions(2)
# Cluster objects only: kustomization.yaml files and KubeSchedulerConfiguration files are not API objects
# (the scheduler configuration has its own tests in test_scheduler_config.py).
NOT_API_OBJECTS = {"Kustomization", "KubeSchedulerConfiguration"}


def _cases() -> list[tuple[str, int, str]]:
    return [(name, i, version) for name, objs in all_renderings().items() for i in range(len(objs))
            for version in VERSIONS]


def test_two_newest_minors_are_distinct_and_recent() -> None:
    assert len(VERSIONS) == 2 and VERSIONS[0] != VERSIONS[1]
    assert all(tuple(map(int, v.split(".")[:2])) >= (1, 30) for v in VERSIONS)


@pytest.mark.parametrize("rendering", sorted(all_renderings()))
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly(rendering: str, version: str) -> None:
    objects = all_renderings()[rendering]
    assert objects, f"{rendering} produced no objects"
    failures = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            failures.append(f"{obj['kind']}/{obj['metadata'].get('name')}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            failures.append(f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message}")
    assert not failures, f"{rendering} against Kubernetes {version}:\n" + "\n".join(failures)


def test_validation_catches_a_broken_object() -> None:
    """The validator really rejects what the API server would (a typo'd field under strict mode)."""
    daemonset = next(o for o in all_renderings()["kustomize:deploy/manifests"] if o["kind"] == "DaemonSet")
    broken = {**daemonset, "spec": {**daemonset["spec"], "updateStrategyy": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("directory", [MANIFESTS, SCHEDULER_DIR], ids=["manifests", "scheduler"])
def test_no_manifest_file_is_left_out_of_a_kustomization(directory) -> None:
    """A YAML file under deploy/manifests that no kustomization lists would never be applied."""
    from tests.deploy.rendering import kustomize_files

    listed = set(kustomize_files(MANIFESTS)) | set(kustomize_files(SCHEDULER_DIR))
    on_disk = {p.resolve() for p in MANIFESTS.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk - listed == set()
    assert all(p.exists() for p in kustomize_files(directory))


def test_unique_object_identities() -> None:
    for name, objects in all_renderings().items():
        ids = [(o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
        duplicates = {i for i in ids if ids.count(i) > 1}
        assert not duplicates, f"{name}: duplicate objects {duplicates}"
