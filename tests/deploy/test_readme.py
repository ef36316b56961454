"""deploy/README.md names only paths, objects and settings that exist."""

from __future__ import annotations

import re

from tests.deploy.rendering import DEPLOY, MANIFESTS, ROOT, SCHEDULER_DIR, find, kustomize_build

README = (DEPLOY / "README.md").read_text()


def test_every_path_it_names_exists() -> None:
    # deploy/<name> after `kubectl logs` / `port-forward` is a Deployment, not a path.
    paths = set(re.findall(r"(?<!logs )(?<!port-forward )(?<![/\w])((?:deploy|scripts|tests)/[\w./-]+|Dockerfile\b)",
                           README))
    assert paths
    for path in paths:
        path = path.rstrip(".")
        assert (ROOT / path).exists() or (DEPLOY / path).exists(), path
    for relative in re.findall(r"`((?:manifests|helm|scheduler|checkov)/[\w./-]*)`", README):
        assert (DEPLOY / relative).exists(), relative


def test_names_match_the_manifests() -> None:
    second = kustomize_build(MANIFESTS)
    https = kustomize_build(SCHEDULER_DIR)
    (deployment,) = find(https, "Deployment")
    secret = next(v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if "secret" in v)
    assert f"create secret generic {secret}" in README
    for service in find(second, "Service") + find(https, "Service"):
        assert service["metadata"]["name"] in README
    assert "schedulerName: gpu-topology-scheduler" in README
    for key in ("plan", "allreduce-gbps", "topology"):
        assert f"gpu-topology.io/{key}" in README or f"gpu-topology\\.io/{key}" in README
