"""The DRA mode in deploy/: chart pieces (DaemonSet, RBAC, NetworkPolicy, DeviceClasses) and the examples in
deploy/dra/, valid for Kubernetes 1.36, wired as the driver reads its settings, and granting exactly its calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.deploy.rendering import DEPLOY, ChartVariant, find, render_chart
from tests.deploy.test_rbac import account_view, declared_calls

DRA_VALUES = {"dra": {"enabled": True}}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render_chart(ChartVariant("gpu-topology", "gpu-topology", DRA_VALUES))


def test_everything_validates_for_1_36(objects: list[dict]) -> None:
    for obj in objects + [d for f in ("deviceclasses.yaml", "claim-templates.yaml")
                          for d in yaml.safe_load_all((DEPLOY / "dra" / f).read_text())]:
        kubernetes_validate.validate(obj, "1.36.0", strict=True)


def test_off_by_default_and_node_groups_choose_the_mode(objects: list[dict]) -> None:
    defaults = render_chart(ChartVariant("gpu-topology", "gpu-topology", {}))
    assert not [o for o in defaults if "dra" in o["metadata"]["name"] or o["kind"] == "DeviceClass"]
    plugin, dra = (find(objects, "DaemonSet", f"gpu-topology-{n}")[0]["spec"]["template"]["spec"]
                   for n in ("plugin", "dra"))
    terms = plugin["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all({"key": "gpu-topology.io/gpu-mode", "operator": "NotIn", "values": ["dra"]} in t["matchExpressions"]
               for t in terms)
    assert dra["nodeSelector"] == {"gpu-topology.io/gpu-mode": "dra"}


def test_driver_arguments_resolve_to_the_mounted_paths(objects: list[dict]) -> None:
    (ds,) = find(objects, "DaemonSet", "gpu-topology-dra")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    out = subprocess.run([sys.executable, "-m", "gpuplugin.cli", *container["args"], "--print-config"],
                         capture_output=True, text=True, env=dict(os.environ, NODE_NAME="node-a"), timeout=60)
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for key in ("registry_dir", "plugin_dir", "cdi_dir"):
        assert host[mounts[settings[key]]] == settings[key], key
    assert settings["node_name"] == "node-a" and settings["topology"] is None
    assert container["ports"][0]["containerPort"] == settings["metrics_port"]


def test_rbac_grants_exactly_the_drivers_calls(objects: list[dict]) -> None:
    (account,) = find(objects, "ServiceAccount", "gpu-topology-dra")
    grants, builtins = account_view(objects, account)
    assert grants == declared_calls()["dra"] and builtins == set()


def test_chart_classes_are_the_example_classes(objects: list[dict]) -> None:
    chart = {o["metadata"]["name"]: o["spec"] for o in find(objects, "DeviceClass")}
    static = {d["metadata"]["name"]: d["spec"] for d in yaml.safe_load_all((DEPLOY / "dra" / "deviceclasses.yaml")
                                                                           .read_text())}
    assert chart == static
    assert chart["gpu.gpu-topology.io"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in chart["one-gpu.gpu-topology.io"]
    # every template asks for classes that exist; "1 GPU" for the singles ordered for 1-GPU claims
    templates = {t["metadata"]["name"]: t["spec"]["spec"]["devices"]["requests"]
                 for t in yaml.safe_load_all((DEPLOY / "dra" / "claim-templates.yaml").read_text())}
    asked = {r.get("exactly", {}).get("deviceClassName") for rs in templates.values() for r in rs} | {
        a["deviceClassName"] for rs in templates.values() for r in rs for a in r.get("firstAvailable", [])}
    assert asked - {None} <= set(static)
    assert templates["one-gpu"][0]["exactly"]["deviceClassName"] == "one-gpu.gpu-topology.io"


def test_the_driver_reads_the_plugins_sharing_configs_and_mps_paths() -> None:
    config = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    values = {"dra": {"enabled": True}, "plugin": {"sharing": {"enabled": True, "default": "mps",
                                                               "configs": {"mps": config}}}}
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    for obj in objects:
        kubernetes_validate.validate(obj, "1.36.0", strict=True)
    (ds,) = find(objects, "DaemonSet", "gpu-topology-dra")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    out = subprocess.run([sys.executable, "-m", "gpuplugin.cli", *container["args"], "--print-config"],
                         capture_output=True, text=True, env=dict(os.environ, NODE_NAME="node-a"), timeout=60)
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (cm,) = find(objects, "ConfigMap", "gpu-topology-plugin-sharing")
    assert volumes[mounts[settings["sharing_config_dir"]]]["configMap"]["name"] == cm["metadata"]["name"]
    assert settings["sharing_config_default"] == "mps" and "mps" in cm["data"]
    assert volumes[mounts[settings["mps_root"]]]["hostPath"]["path"] == settings["mps_root"]
    assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == settings["mps_root"] + "/shm"
    assert pod["hostPID"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
