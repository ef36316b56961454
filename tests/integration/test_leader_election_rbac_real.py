"""`gpu-extender serve --leader-elect` run by an account that may not use its Lease, against the real kube-apiserver
v1.36.2 with the chart's RBAC applied (the second-scheduler account, whose Role covers kube-scheduler's Lease, not
the extender's; the kustomize RBAC had none either). Before, such a replica logged only "campaigning", answered
503 to every verb and reported ready: a Deployment rolled on, a PodDisruptionBudget counted it, nothing said why.
Now it is not ready, its verbs say why, and one error line names the Lease and what the account needs.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import httpx
import pytest

from sim.ports import free_ports
from tests.helpers.controlplane import ControlPlane, start_process, tidied, wait_until
from tests.helpers.paths import REPO

NS = "gpu-topology"
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
              "ValidatingAdmissionPolicyBinding")
WAIT = 60.0  # liveness bound of the waits, never a performance figure

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    from tests.deploy.rendering import ChartVariant, render_chart

    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(NS)
        for obj in render_chart(ChartVariant("gpu-topology", NS, {})):
            if obj["kind"] in RBAC_KINDS:
                cp.create(obj)
        yield cp


def test_an_account_without_the_lease_role_is_not_ready_and_says_why_once(cluster: ControlPlane) -> None:
    cp = cluster
    port, mport = free_ports(2)
    proc = start_process("extender-no-lease-role", [
        sys.executable, "-m", "extender.cli", "serve", "--kubeconfig", str(cp.extender_kubeconfig()),
        "--port", str(port), "--metrics-port", str(mport), "--metrics-host", "127.0.0.1",
        "--leader-elect", "--leader-elect-namespace", NS, "--leader-elect-retry-period", "1",
        "--leader-elect-renew-deadline", "3", "--leader-elect-lease-duration", "5", "--log-level", "info",
    ], cp.dir / "extender-no-lease-role.log", env={**os.environ, "PYTHONUNBUFFERED": "1", "POD_NAME": "ext-x"},
        cwd=REPO)
    cp.procs.append(proc)

    def refused_ready() -> bool:
        r = httpx.get(f"http://127.0.0.1:{mport}/readyz", timeout=2)
        return r.status_code == 503 and "leader election cannot get the Lease" in r.text

    wait_until("/readyz refusing with the Lease's 403", refused_ready, WAIT, proc, 0.2)
    ready = httpx.get(f"http://127.0.0.1:{mport}/readyz", timeout=2).text
    assert f"{NS}/gpu-extender: 403" in ready, ready
    r = httpx.post(f"http://127.0.0.1:{port}/filter", json={"Pod": {"metadata": {"name": "p"}}, "NodeNames": []},
                   timeout=10)
    assert r.status_code == 503 and "cannot lead" in r.json()["Error"], r.text
    # said once (that it is said once over many retries is checked where requests can be counted:
    # tests/extender/test_transitions.py)
    lines = [json.loads(line) for line in proc.log.read_text(errors="replace").splitlines()
             if line.startswith("{")]
    forbidden = [e for e in lines if e.get("event") == "kube.election.forbidden"]
    assert len(forbidden) == 1 and forbidden[0]["level"] == "error", forbidden
    assert forbidden[0]["lease"] == f"{NS}/gpu-extender"
    assert not [e for e in lines if e.get("event") == "kube.election.leading"]
