"""`gpuplugin dra` as a process on a node: registers with the kubelet stand-in, publishes, prepares, serves its
metrics on the process's registry, stops cleanly on SIGTERM, and calls exactly the Kubernetes API that
deploy/rbac-calls.yaml declares for it (so its RBAC grants)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

from sim.dra_allocator import Alternative, Request, allocate, by_size
from sim.dra_kubelet import DraKubeletSim
from sim.ports import free_port
from tests.deploy.test_rbac_calls import assert_equals_table, declared, observed
from tests.fakes.kubeapi import FakeDraKubeApi
from tests.gpuplugin.dra.conftest import DGX1, DRIVER, NODE, RECORDED_CLAIM
from tests.helpers.kube import write_kubeconfig
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import stop_process

WAIT = 30.0  # liveness bound on a loaded machine, never a performance figure


def test_driver_process_serves_a_claim_and_calls_only_its_declared_api() -> None:
    import json

    with short_dir("drap-") as root, FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": NODE}})
        stale = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "left-over"},
                 "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 9,
                                                                       "resourceSliceCount": 1},
                          "devices": []}}
        fake._create_object("resourceslices", stale)
        env = dict(os.environ, KUBECONFIG=str(write_kubeconfig(root / "kubeconfig", fake.url)), NODE_NAME=NODE)
        args = [sys.executable, "-m", "gpuplugin.cli", "dra", "--topology", str(DGX1), "--registry-dir",
                str(root / "registry"), "--plugin-dir", str(root / "plugin"), "--cdi-dir", str(root / "cdi"),
                "--metrics-port", str(port := free_port()), "--min-publish-interval", "0", "--log-level",
                "warning"]
        with open(root / "log", "w") as log, DraKubeletSim(root / "registry", NODE) as kubelet:
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                kubelet.wait_registered(DRIVER, timeout=WAIT)
                assert eventually(lambda: len(fake.slices(NODE)) == 4 and len(
                    {s["spec"]["pool"]["generation"] for s in fake.slices(NODE)}) == 1, WAIT), "no pool"
                body = json.loads(RECORDED_CLAIM.read_text())
                body["metadata"] = {"name": "c1", "namespace": "default"}
                uid = fake.add_claim(body)["metadata"]["uid"]
                got = allocate(fake.slices(NODE), [], [Request("gpus", (Alternative(by_size(DRIVER, 2)),))])
                assert got is not None
                fake.allocate_claim("default", "c1", NODE, [{"request": "gpus", "driver": DRIVER, "pool": NODE,
                                                             "device": got.devices["gpus"][0].device}])
                devices = kubelet.prepare(DRIVER, [("default", uid, "c1")])[uid]
                assert devices[0].device_name == got.devices["gpus"][0].device
                assert eventually(lambda: (root / "cdi" / f"{DRIVER}-claim_{uid}.json").exists(), WAIT), (
                    "no CDI spec")
                base = f"http://127.0.0.1:{port}"
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as health:
                    assert health.status == 200
                with urllib.request.urlopen(f"{base}/metrics", timeout=5) as scraped:
                    metrics = scraped.read().decode()
                for series in ('gpuplugin_dra_prepares_total{result="ok"} 1.0', "process_cpu_seconds_total",
                               "python_info", 'gpuplugin_dra_kube_watch_events_total{kind="resourceslices"'):
                    assert series in metrics, series
            finally:
                stop_process(proc, WAIT)
                assert proc.returncode == 0, (root / "log").read_text()
        assert not (root / "plugin" / "dra.sock").exists()
        assert not (root / "registry" / f"{DRIVER}-reg.sock").exists()
        assert_equals_table("dra", list(fake.requests))


def test_driver_process_shares_the_gpus_its_labelled_config_shares() -> None:
    with short_dir("draps-") as root, FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": NODE, "labels": {"nvidia.com/device-plugin.config": "two"}}})
        configs = root / "sharing"
        configs.mkdir()
        for name, replicas in (("default", 4), ("two", 2)):
            (configs / name).write_text(f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                        f"      - name: nvidia.com/gpu\n        rename: nvidia.com/gpu.shared\n"
                                        f"        replicas: {replicas}\n        devices: [0, 1]\n")
        env = dict(os.environ, KUBECONFIG=str(write_kubeconfig(root / "kubeconfig", fake.url)), NODE_NAME=NODE)
        args = [sys.executable, "-m", "gpuplugin.cli", "dra", "--topology", str(DGX1), "--registry-dir",
                str(root / "registry"), "--plugin-dir", str(root / "plugin"), "--cdi-dir", str(root / "cdi"),
                "--metrics-port", str(port := free_port()), "--min-publish-interval", "0", "--log-level",
                "warning", "--sharing-config-dir", str(configs)]
        with open(root / "log", "w") as log, DraKubeletSim(root / "registry", NODE) as kubelet:
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                kubelet.wait_registered(DRIVER, timeout=WAIT)

                def devices() -> dict[str, dict]:
                    return {d["name"]: d for s in fake.slices(NODE) for d in s["spec"].get("devices") or ()}
                assert eventually(lambda: "shared-1" in devices(), WAIT), (root / "log").read_text()
                got = devices()
                assert got["shared-0"]["capacity"]["replicas"]["value"] == "2"  # the labelled config, not default
                assert got["shared-0"]["allowMultipleAllocations"] is True
                assert "gpu-0" not in got and "gpu-2" in got
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as scraped:
                    assert "gpuplugin_dra_consumable_capacity 1.0" in scraped.read().decode()
            finally:
                stop_process(proc, WAIT)
                assert proc.returncode == 0, (root / "log").read_text()
        # the label is read with a call the table grants already: nothing undeclared is called
        assert observed(list(fake.requests)) <= declared("dra")
