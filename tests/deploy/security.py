"""Container-security rules every workload in deploy/ must follow; the same ground checkov covers, in plain Python.

The one exception is declared here, not hidden in the manifests: the device plugin's container runs as uid 0
(no capabilities, no privilege escalation) because it must create its socket in the host's root-owned
/var/lib/kubelet/device-plugins; see Dockerfile.plugin and deploy/README.md.
"""

from __future__ import annotations

from typing import Any

from tests.deploy.rendering import Obj, containers

WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob", "Pod", "ReplicaSet"}
# (workload kind, app.kubernetes.io/component label, container name) allowed to run as uid 0: the MPS control
# daemon set too (its daemons' pipe directories live on the root-owned MPS root).
ROOT_ALLOWED = {("DaemonSet", "device-plugin", "plugin"), ("DaemonSet", "mps-control", "mps-control")}
# The node agents that may mount host paths; with MPS both need the host's PID namespace (the MPS server checks its
# clients' process ids; NVIDIA's MPS daemon set has it too).
NODE_AGENTS = {("DaemonSet", "device-plugin"), ("DaemonSet", "mps-control")}
HOST_PID_ALLOWED = NODE_AGENTS
# hostPath volumes the node agents may mount, and whether the mount must be read-only (the MPS root: the chart's
# default plugin.sharing.mps.root).
HOST_PATHS = {"/var/lib/kubelet/device-plugins": False, "/var/lib/kubelet/pod-resources": True,
              "/run/nvidia/mps": False, "/run/nvidia/mps/shm": False}


def _component(obj: Obj) -> str:
    return obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component", "")


def _effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    """A securityContext field as the kubelet applies it: the container's value, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def workload_findings(obj: Obj) -> list[str]:
    if obj.get("kind") not in WORKLOAD_KINDS:
        return []
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    pod = obj["spec"]["template"]["spec"]
    found: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field) and not (field == "hostPID" and (obj["kind"], _component(obj)) in HOST_PID_ALLOWED):
            found.append(f"{where}: {field} is on")
    host_volumes = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
    if host_volumes and (obj["kind"], _component(obj)) not in NODE_AGENTS:
        found.append(f"{where}: hostPath volumes {sorted(host_volumes.values())} outside the node agents")
    for path in host_volumes.values():
        if path not in HOST_PATHS:
            found.append(f"{where}: hostPath {path} is not one the device plugin needs")
    for _, container in containers(obj):
        name = f"{where}/{container['name']}"
        ctx = container.get("securityContext", {})
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if ctx.get("readOnlyRootFilesystem") is not True:
            found.append(f"{name}: readOnlyRootFilesystem must be true")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name}: capabilities must drop ALL")
        if caps.get("add"):
            found.append(f"{name}: adds capabilities {caps['add']}")
        if _effective(pod, container, "seccompProfile") != {"type": "RuntimeDefault"}:
            found.append(f"{name}: seccompProfile must be RuntimeDefault")
        root_allowed = (obj["kind"], _component(obj), container["name"]) in ROOT_ALLOWED
        if root_allowed:
            if _effective(pod, container, "runAsUser") != 0:
                found.append(f"{name}: the root exemption expects an explicit runAsUser 0")
        elif _effective(pod, container, "runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot must be true")
        elif _effective(pod, container, "runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        resources = container.get("resources", {})
        for section in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                if resource not in resources.get(section, {}):
                    found.append(f"{name}: resources.{section}.{resource} missing")
        # a run-to-completion pod (the uninstall hook's Job) serves nothing a probe could ask about
        for probe in ("livenessProbe", "readinessProbe") if obj["kind"] not in ("Job", "CronJob") else ():
            if probe not in container:
                found.append(f"{name}: {probe} missing")
        image = container.get("image", "")
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        if not tag or tag == "latest":
            found.append(f"{name}: image {image!r} has no pinned tag")
        if any("hostPort" in port for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
        for mount in container.get("volumeMounts", []):
            path = host_volumes.get(mount["name"])
            if path is not None and HOST_PATHS.get(path) and not mount.get("readOnly"):
                found.append(f"{name}: {path} must be mounted read-only")
    return found


def service_findings(obj: Obj) -> list[str]:
    if obj.get("kind") != "Service":
        return []
    kind = obj["spec"].get("type", "ClusterIP")
    return [] if kind == "ClusterIP" else [f"Service/{obj['metadata']['name']}: type {kind} exposes it outside"]


def findings(objects: list[Obj]) -> list[str]:
    return [f for obj in objects for f in (*workload_findings(obj), *service_findings(obj))]
