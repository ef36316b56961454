"""Every object deploy/ can produce validates strictly against the Kubernetes OpenAPI schemas of every minor version
the project claims (Chart.yaml's kubeVersion floor, which README.md states, to the newest kubernetes-validate
ships), offline.

The chart's output depends on the cluster's version only through kube-scheduler's image tag (a test below proves
it), so each rendering is made once and its distinct objects are validated against each version.
"""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest

from tests.deploy import schemas
from tests.deploy.rendering import (
    CHART_VARIANTS,
    MANIFESTS,
    ROOT,
    SCHEDULER_DIR,
    all_renderings,
    containers,
    find,
    generated_masked,
    render_chart,
    without_webhook,
)

VERSIONS = schemas.supported_versions()


def _distinct_objects() -> list[tuple[str, dict]]:
    """(renderings that produce it, object) for every distinct object of every rendering."""
    seen: dict[str, tuple[list[str], dict]] = {}
    for name, objects in all_renderings().items():
        for obj in objects:
            key = json.dumps(obj, sort_keys=True)
            seen.setdefault(key, ([], obj))[0].append(name)
    return [(", ".join(names), obj) for names, obj in seen.values()]


def test_versions_run_from_the_claimed_floor_to_the_newest_shipped() -> None:
    shipped = sorted({schemas.minor(v) for v in kubernetes_validate.utils.all_versions()})
    assert [schemas.minor(v) for v in VERSIONS] == [m for m in shipped if m >= schemas.oldest_supported()]
    assert schemas.minor(VERSIONS[0]) == schemas.oldest_supported() and len(VERSIONS) >= 2


def test_readme_claims_what_is_validated() -> None:
    """README.md and deploy/README.md state the floor that Chart.yaml enforces and the range tested here."""
    oldest, newest = (".".join(map(str, schemas.minor(v))) for v in (VERSIONS[0], VERSIONS[-1]))
    readme = (ROOT / "README.md").read_text()
    deploy_readme = (ROOT / "deploy" / "README.md").read_text()
    for text in (readme, deploy_readme):
        assert f"Kubernetes {oldest} or newer" in text
        assert f"Kubernetes {oldest} to {newest}" in text
        assert not re.search(r"Kubernetes 1\.\d+ and 1\.\d+", text), "an older, narrower claim is left"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly(version: str) -> None:
    problems = []
    for where, obj in _distinct_objects():
        problems += [f"[{where}] {line}" for line in schemas.failures([obj], version)]
    assert not problems, f"against Kubernetes {version}:\n" + "\n".join(problems)


def test_chart_output_depends_on_the_cluster_version_only_through_the_scheduler_image() -> None:
    """What lets the test above validate one rendering per variant against every version."""
    oldest, newest = (f"v{v}" for v in (VERSIONS[0], VERSIONS[-1]))
    for name, variant in CHART_VARIANTS.items():
        early, late = (generated_masked(render_chart(variant, v)) for v in (oldest, newest))
        for obj in early + late:
            for _, container in containers(obj):
                if container["name"] == "kube-scheduler":
                    container["image"] = container["image"].rsplit(":", 1)[0]
        assert early == late, name


@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1], "1.33.5-eks-2d5f260", "1.32.2-gke.1182003"])
def test_default_kube_scheduler_follows_the_cluster(version: str) -> None:
    """kube-scheduler must not be newer than kube-apiserver: by default its tag is the cluster's own version,
    provider suffixes dropped (the upstream image has tags vX.Y.Z only)."""
    (deployment,) = find(without_webhook(render_chart(CHART_VARIANTS["defaults"], f"v{version}")), "Deployment")
    images = {c["name"]: c["image"] for _, c in containers(deployment)}
    plain = ".".join(re.findall(r"\d+", version)[:3])
    assert images["kube-scheduler"] == f"registry.k8s.io/kube-scheduler:v{plain}"
    # An explicit tag wins (a mirror without that tag).
    (custom,) = find(without_webhook(render_chart(CHART_VARIANTS["custom"], f"v{version}")), "Deployment")
    assert {c["name"]: c["image"] for _, c in containers(custom)}["kube-scheduler"].endswith(":v1.35.4")


def test_validation_catches_a_broken_object() -> None:
    """The validator really rejects what the API server would (a typo'd field under strict mode)."""
    daemonset = next(o for o in all_renderings()["kustomize:deploy/manifests"] if o["kind"] == "DaemonSet")
    broken = {**daemonset, "spec": {**daemonset["spec"], "updateStrategyy": {}}}
    assert schemas.failures([broken], VERSIONS[-1])
    assert schemas.failures([daemonset], VERSIONS[-1]) == []


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


def _render_umbrella(tmp_path, values: dict) -> dict[str, str]:
    """Template path -> text of a parent chart that lists this chart with `condition: gpu-topology.enabled`,
    rendered by Helm's own engine (the one `helm template` runs), so Helm's dependency handling and values-schema
    check are the real ones."""
    import shutil

    import helm_python
    import yaml
    from helm_python import _native as helm_native

    from tests.deploy.rendering import CHART

    umbrella = tmp_path / "umbrella"
    shutil.copytree(CHART, umbrella / "charts" / "gpu-topology")
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "umbrella", "version": "0.0.1",
        "dependencies": [{"name": "gpu-topology", "version": version, "condition": "gpu-topology.enabled"}]}))
    chart = helm_python.Chart.load(umbrella)
    options = {"name": "platform", "namespace": "platform", "is_install": True}
    return dict(json.loads(helm_native.call_string("helm_render", chart._raw(), json.dumps(values),
                                                   json.dumps(options))))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_parent_chart_can_switch_the_chart_off(tmp_path, enabled: bool) -> None:
    """`condition: gpu-topology.enabled` in a parent chart passes `enabled` down: the schema must allow it."""
    files = _render_umbrella(tmp_path, {"gpu-topology": {"enabled": enabled}})
    ours = [path for path, text in files.items() if path.startswith("umbrella/charts/gpu-topology/") and text.strip()]
    if enabled:
        assert any(path.endswith("plugin-daemonset.yaml") for path in ours), sorted(files)
    else:
        assert ours == []


@pytest.mark.parametrize("enabled", [True, False])
def test_the_chart_itself_ignores_enabled(enabled: bool) -> None:
    from tests.deploy.rendering import ChartVariant

    alone = render_chart(ChartVariant("gpu-topology", "gpu-topology", {"enabled": enabled}))
    assert generated_masked(alone) == generated_masked(render_chart(CHART_VARIANTS["defaults"]))


def test_enabled_must_be_a_boolean() -> None:
    import helm_python

    from tests.deploy.rendering import ChartVariant

    with pytest.raises(helm_python.HelmError, match="enabled"):
        render_chart(ChartVariant("gpu-topology", "gpu-topology", {"enabled": "no"}))
