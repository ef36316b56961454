"""Static security checks of every workload deploy/ can produce; checkov too when its venv is there."""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy import security
from tests.deploy.rendering import DEPLOY, ROOT, Obj, all_renderings, containers, find, rendering_names

CHECKOV_VENV = Path("/tmp/checkov-venv")


@pytest.mark.parametrize("rendering", rendering_names())
def test_container_security_rules(rendering: str) -> None:
    assert security.findings(all_renderings()[rendering]) == []


@pytest.mark.parametrize("rendering", rendering_names())
def test_every_workload_pod_is_covered_by_a_network_policy(rendering: str) -> None:
    objects = all_renderings()[rendering]
    policies = find(objects, "NetworkPolicy")
    if rendering == "helm:minimal":
        assert policies == []  # networkPolicy.enabled=false
        return
    for workload in [o for o in objects if o["kind"] in security.WORKLOAD_KINDS]:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies
                     if p["metadata"]["namespace"] == workload["metadata"]["namespace"]
                     and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert selecting, f"{rendering}: no NetworkPolicy selects {workload['metadata']['name']}"
        named_ports = {p["name"]: p["containerPort"] for _, c in containers(workload) for p in c.get("ports", [])}
        for policy in selecting:
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            for rule in policy["spec"]["ingress"]:
                for port in rule["ports"]:
                    assert port["port"] in named_ports, f"{policy['metadata']['name']}: port {port['port']}"
                    # Only metrics ports, plus the HTTPS API of a standalone extender (the scheduler calls it).
                    assert "metrics" in port["port"] or port["port"] == "https", port


def _mutate(objects: list[Obj], kind: str, change: Callable[[Obj], None]) -> list[Obj]:
    copied = copy.deepcopy(objects)
    change(next(o for o in copied if o["kind"] == kind))
    return copied


def _first_container(obj: Obj) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


BREAKAGES: dict[str, tuple[str, Callable[[Obj], None]]] = {
    "privileged": ("Deployment", lambda o: _first_container(o)["securityContext"].update(privileged=True)),
    "escalation": ("Deployment",
                   lambda o: _first_container(o)["securityContext"].update(allowPrivilegeEscalation=True)),
    "writable root": ("DaemonSet",
                      lambda o: _first_container(o)["securityContext"].update(readOnlyRootFilesystem=False)),
    "caps kept": ("Deployment", lambda o: _first_container(o)["securityContext"].pop("capabilities")),
    "cap added": ("DaemonSet",
                  lambda o: _first_container(o)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"])),
    "root scheduler": ("Deployment", lambda o: _first_container(o)["securityContext"].update(runAsNonRoot=False)),
    "host network": ("DaemonSet", lambda o: o["spec"]["template"]["spec"].update(hostNetwork=True)),
    "no limits": ("DaemonSet", lambda o: _first_container(o)["resources"].pop("limits")),
    "no probe": ("Deployment", lambda o: _first_container(o).pop("readinessProbe")),
    "latest": ("DaemonSet", lambda o: _first_container(o).update(image="gpu-topology:latest")),
    "host root": ("DaemonSet", lambda o: o["spec"]["template"]["spec"]["volumes"][0]["hostPath"].update(path="/")),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_checker_catches_each_rule(case: str) -> None:
    kind, change = BREAKAGES[case]
    broken = _mutate(all_renderings()["kustomize:deploy/manifests"], kind, change)
    assert security.findings(broken)


@pytest.mark.skipif(not (CHECKOV_VENV.is_dir() or os.environ.get("RUN_CHECKOV") == "1"),
                    reason="checkov lives in its own venv (deploy/checkov/run.sh creates /tmp/checkov-venv; slow)")
def test_checkov_passes() -> None:
    result = subprocess.run(["bash", str(DEPLOY / "checkov" / "run.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
