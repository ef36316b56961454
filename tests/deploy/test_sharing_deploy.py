"""The chart's GPU sharing values: NVIDIA's config files land unchanged in a ConfigMap the plugin reads, the plugin
gets the MPS hostPath volumes and flags, bad values fail naming them, and with sharing off nothing changes."""

from __future__ import annotations

import helm_python
import pytest

from gpuplugin.config import SETTINGS
from gpuplugin.sharing.config import parse_config
from tests.deploy.rendering import ChartVariant, containers, find, render_chart, render_chart_files

NVIDIA_TS = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n"
NVIDIA_MPS = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n" \
             "      replicas: 4\n"


def _plugin(objects: list[dict]) -> tuple[dict, dict]:
    (ds,) = find(objects, "DaemonSet", "gpu-topology-plugin")
    (_, container), *_ = list(containers(ds))
    return ds, container


def test_sharing_configs_reach_the_plugin_unchanged() -> None:
    values = {"plugin": {"sharing": {"enabled": True, "default": "ts", "configs": {"ts": NVIDIA_TS,
                                                                                  "mps": NVIDIA_MPS}}}}
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    (cm,) = find(objects, "ConfigMap", "gpu-topology-plugin-sharing")
    assert cm["data"]["ts"].strip() == NVIDIA_TS.strip() and cm["data"]["mps"].strip() == NVIDIA_MPS.strip()
    assert parse_config(cm["data"]["mps"]).strategy == "mps"
    ds, container = _plugin(objects)
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    args = container["args"]
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    assert flags["--sharing-config-dir"] == "/etc/gpu-topology/sharing"
    assert flags["--sharing-config-default"] == "ts"
    assert flags["--sharing-config-label"] == "nvidia.com/device-plugin.config"
    assert flags["--mps-root"] == "/run/nvidia/mps"
    # every flag the chart passes is one gpuplugin run knows
    known = {f"--{s.flag}" for s in SETTINGS.settings} | {f"--no-{s.flag}" for s in SETTINGS.settings if s.is_bool}
    assert {a.split("=", 1)[0] for a in args if a.startswith("--")} <= known
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["mps-root"] == "/run/nvidia/mps" and mounts["mps-shm"] == "/dev/shm"
    assert mounts["sharing-config"] == "/etc/gpu-topology/sharing"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["mps-root"]["hostPath"] == {"path": "/run/nvidia/mps", "type": "DirectoryOrCreate"}
    assert volumes["mps-shm"]["hostPath"]["path"] == "/run/nvidia/mps/shm"
    assert volumes["sharing-config"]["configMap"]["name"] == "gpu-topology-plugin-sharing"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


def test_an_existing_configmap_and_gfd_labels_off() -> None:
    values = {"plugin": {"sharing": {"enabled": True, "configMapName": "team-configs", "gfdLabels": False,
                                     "mps": {"root": "/run/mps", "hostPID": False}}}}
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    assert not find(objects, "ConfigMap", "gpu-topology-plugin-sharing")
    ds, container = _plugin(objects)
    assert "hostPID" not in ds["spec"]["template"]["spec"]
    assert "--no-sharing-labels" in container["args"] and "--mps-root=/run/mps" in container["args"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["sharing-config"]["configMap"]["name"] == "team-configs"


def test_sharing_off_changes_nothing() -> None:
    ds, container = _plugin(render_chart(ChartVariant("gpu-topology", "gpu-topology", {})))
    assert not any(a.startswith("--sharing") or a.startswith("--mps") for a in container["args"])
    assert "hostPID" not in ds["spec"]["template"]["spec"]
    assert {e["name"]: e.get("value") for e in container["env"]}["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


@pytest.mark.parametrize(("sharing", "named"), [
    ({"enabled": True}, "plugin.sharing.configs"),
    ({"enabled": True, "configs": {"a": NVIDIA_TS}, "default": "b"}, '"b" is not among'),
    ({"enabled": True, "configs": {"a": NVIDIA_TS}, "mps": {"root": "run/mps"}}, "/plugin/sharing/mps/root"),
    ({"enabled": True, "colour": "red"}, "colour"),
])
def test_bad_sharing_values_fail_naming_them(sharing: dict, named: str) -> None:
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology", {"plugin": {"sharing": sharing}}))
    assert named in str(caught.value)


def _control(objects: list[dict]) -> list[dict]:
    return find(objects, "DaemonSet", "gpu-topology-mps-control")


def test_the_mps_control_daemon_set_runs_beside_the_plugin_on_its_nodes() -> None:
    """Sharing on (daemons: external by default): the control daemon set gets the plugin's image and nodes, the
    same MPS hostPath root, the host PID namespace and the driver's compute part, and a chart upgrade does not
    restart it; the plugin is told the daemons are external. Every object also passes the security and schema
    checks as the `sharing-mps` rendering (tests/deploy/rendering.py)."""
    from gpuplugin.commands.mps_control import SETTINGS as CONTROL
    from tests.deploy.rendering import CHART_VARIANTS

    objects = render_chart(CHART_VARIANTS["sharing-mps"])
    plugin, plugin_container = _plugin(objects)
    (control,) = _control(objects)
    (_, container), = list(containers(control))
    pod, plugin_pod = control["spec"]["template"]["spec"], plugin["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and control["spec"]["updateStrategy"] == {"type": "OnDelete"}
    for key in ("nodeSelector", "affinity", "tolerations"):
        assert pod[key] == plugin_pod[key], key
    assert container["image"] == plugin_container["image"] and container["command"] == ["gpuplugin"]
    args = container["args"]
    assert args[0] == "mps-control"
    settings = CONTROL.load({k.removeprefix("--").replace("-", "_"): v for k, v in
                             (a.split("=", 1) for a in args[1:])}, env={})
    assert "--mps-daemons=external" in plugin_container["args"]
    assert f"--mps-root={settings.mps_root}" in plugin_container["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["mps-root"] == {v["name"]: v for v in plugin_pod["volumes"]}["mps-root"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["mps-root"] == str(settings.mps_root) and mounts["mps-shm"] == "/dev/shm"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    (metrics,) = container["ports"]
    assert metrics["containerPort"] == settings.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert find(objects, "NetworkPolicy", "gpu-topology-mps-control")


def test_in_plugin_daemons_or_sharing_off_render_no_control_daemon_set() -> None:
    values = {"plugin": {"sharing": {"enabled": True, "configs": {"a": NVIDIA_MPS}, "mps": {"daemons": "in-plugin"}}}}
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    assert not _control(objects)
    assert "--mps-daemons=in-plugin" in _plugin(objects)[1]["args"]
    assert not _control(render_chart(ChartVariant("gpu-topology", "gpu-topology", {})))


@pytest.mark.parametrize(("mps", "named"), [
    ({"daemons": "sidecar"}, "/plugin/sharing/mps/daemons"),
    ({"control": {"updateStrategy": "Never"}}, "/plugin/sharing/mps/control/updateStrategy"),
    ({"control": {"pollInterval": 0}}, "/plugin/sharing/mps/control/pollInterval"),
])
def test_bad_mps_control_values_fail_naming_them(mps: dict, named: str) -> None:
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology",
                                        {"plugin": {"sharing": {"enabled": True, "configs": {"a": NVIDIA_TS},
                                                                "mps": mps}}}))
    assert named in str(caught.value)


# -- every name the sharing configs advertise reaches the extender and the webhook ---------------------------------

RENAMING = {
    "mps-default-names": NVIDIA_MPS,  # nvidia.com/gpu.shared
    "ts-renamed": "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                  "    - name: nvidia.com/gpu\n      replicas: 4\n      rename: acme.example/inference\n"
                  "      devices: [0, 1]\n    - name: nvidia.com/mig-1g.12gb\n      replicas: 2\n",
    "whole": "version: v1\n",
    "json": '{"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, '
            '"rename": "acme.example/notebook"}]}}}',
}


def _advertised(text: str) -> list[str]:
    """What the plugin advertises for the config's shared entries (gpuplugin.sharing.layout's rule)."""
    section = parse_config(text).section
    if section is None:
        return []
    return [e.rename or (e.name + ".shared" if section.rename_by_default else e.name) for e in section.resources]


def _second_scheduler_names(objects: list[dict]) -> list[str] | None:
    import yaml

    (cm,) = find(objects, "ConfigMap", "gpu-topology-scheduler-config")
    (ext,) = yaml.safe_load(cm["data"]["scheduler-config.yaml"])["extenders"]
    managed = ext.get("managedResources")
    return None if managed is None else [m["name"] for m in managed]


def test_every_name_the_sharing_configs_advertise_is_a_managed_resource() -> None:
    """Issue A: pods asking `nvidia.com/gpu.shared` (renameByDefault) were bound by kube-scheduler alone, since
    managedResources named only the GPU and the MIG names. Every name the chart's configs make the plugin advertise
    (as gpuplugin.sharing resolves them), NVIDIA's default shared names and plugin.sharing.resourceNames (configs
    kept outside the chart) are listed, each once; the webhook manages the same pods."""
    values = {"plugin": {"sharing": {"enabled": True, "configs": RENAMING,
                                     "resourceNames": ["acme.example/outside", "nvidia.com/gpu.shared"]}}}
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", values))
    names = _second_scheduler_names(objects)
    assert names is not None and len(names) == len(set(names)), names
    advertised = {n for text in RENAMING.values() for n in _advertised(text)}
    assert advertised == {"nvidia.com/gpu.shared", "acme.example/inference", "nvidia.com/mig-1g.12gb.shared",
                          "acme.example/notebook"}
    assert advertised | {"acme.example/outside", "nvidia.com/gpu", "nvidia.com/mig-1g.10gb.shared"} <= set(names)
    (deployment,) = find(objects, "Deployment", "gpu-topology-webhook")
    (_, webhook), = list(containers(deployment))
    extra = next(a for a in webhook["args"] if a.startswith("--extra-resources="))
    # the names the webhook does not know by rule (resourceName, its .shared name, <domain>/mig-*)
    assert sorted(extra.split("=", 1)[1].split(",")) == ["acme.example/inference", "acme.example/notebook",
                                                          "acme.example/outside"]


def test_default_shared_names_are_listed_without_any_config_and_a_config_that_is_not_yaml_fails() -> None:
    names = _second_scheduler_names(render_chart(ChartVariant("gpu-topology", "gpu-topology", {})))
    assert names is not None and "nvidia.com/gpu.shared" in names and "nvidia.com/mig-3g.40gb.shared" in names
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology", {"plugin": {"sharing": {
            "enabled": True, "configs": {"broken": "version: v1\nsharing: [\n"}}}}))
    assert "plugin.sharing.configs.broken is not YAML" in str(caught.value)


def test_whole_jobs_renders_the_scheduler_without_managed_resources() -> None:
    """Issue B: with webhook.wholeJobs a TFJob's parameter servers (no GPU) come to this scheduler, and
    kube-scheduler asks an extender listing managedResources only about pods naming one: the list is left out, so
    every pod of this scheduler reaches the extender (it only gets the pods sent to it)."""
    on = render_chart(ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"wholeJobs": True}}))
    assert _second_scheduler_names(on) is None
    off = render_chart(ChartVariant("gpu-topology", "gpu-topology", {}))
    assert _second_scheduler_names(off)
