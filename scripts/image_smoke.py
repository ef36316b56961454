"""A standalone extender inside the image answers kube-scheduler's filter call (run by scripts/build_image.sh as
`python -c "$(cat scripts/image_smoke.py)"` in a container of the image: standard library only, no file of the
repository).

It starts `gpu-extender serve --inventory` on a free loopback port with two nodes made from the topologies the
package ships (a DGX-1 with 8 free GPUs, the same machine with 6 of them in use), waits for /readyz, POSTs the
ExtenderArgs kube-scheduler sends with nodeCacheCapable (pod, node names, Nodes null) for a 4-GPU pod, and checks the
answer: the free node passes, the busy one fails with a reason, an unknown node is not passed. Exits non-zero with
the extender's log on any mismatch.
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib.resources import files
from pathlib import Path

LIMIT_S = 60.0  # start-up bound on a loaded machine, not a performance figure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def filter_body(nodes: list[str]) -> dict:
    """ExtenderArgs as kube-scheduler v1.3x sends it to a nodeCacheCapable extender (recorded shape)."""
    pod = {
        "metadata": {"name": "train-4gpu", "namespace": "default", "uid": "0ec6ac7a-ae43-441c-a3d1-973121e0dbf9",
                     "resourceVersion": "224", "creationTimestamp": "2026-11-30T10:27:55Z", "generation": 1},
        "spec": {
            "containers": [{"name": "main", "image": "registry.invalid/none:0", "imagePullPolicy": "IfNotPresent",
                            "resources": {"limits": {"nvidia.com/gpu": "4"}, "requests": {"nvidia.com/gpu": "4"}},
                            "terminationMessagePath": "/dev/termination-log",
                            "terminationMessagePolicy": "File"}],
            "dnsPolicy": "ClusterFirst", "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0, "restartPolicy": "Always", "schedulerName": "gpu-topology-scheduler",
            "securityContext": {}, "serviceAccount": "default", "serviceAccountName": "default",
            "terminationGracePeriodSeconds": 30,
        },
        "status": {"phase": "Pending", "qosClass": "BestEffort"},
    }
    return {"Pod": pod, "NodeNames": nodes, "Nodes": None}


def main() -> int:
    work = Path(tempfile.mkdtemp())
    topology = files("gputopo") / "data" / "dgx1-v100-hybrid-cube-mesh.txt"
    (work / "inventory.yaml").write_text(
        "nodes:\n"
        f"  - name: dgx1-free\n    topology: {topology}\n"
        f"  - name: dgx1-busy\n    topology: {topology}\n    used: [GPU0, GPU1, GPU2, GPU3, GPU4, GPU5]\n"
    )
    port = free_port()
    log = open(work / "extender.log", "wb")  # noqa: SIM115 - held open for the child's lifetime
    server = subprocess.Popen(["gpu-extender", "serve", "--inventory", str(work / "inventory.yaml"),
                               "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LIMIT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"gpu-extender exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gpu-extender not ready after {LIMIT_S:.0f} s")
            time.sleep(0.2)
        request = urllib.request.Request(
            f"{base}/filter", data=json.dumps(filter_body(["dgx1-free", "dgx1-busy", "not-in-inventory"])).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            answer = json.load(reply)
        print("POST /filter ->", json.dumps(answer, sort_keys=True))
        failed = {**(answer.get("FailedNodes") or {}), **(answer.get("FailedAndUnresolvableNodes") or {})}
        problems = []
        if answer.get("Error"):
            problems.append(f"Error: {answer['Error']}")
        if answer.get("NodeNames") != ["dgx1-free"]:
            problems.append(f"NodeNames {answer.get('NodeNames')} != ['dgx1-free']")
        if not failed.get("dgx1-busy"):
            problems.append("dgx1-busy has no failure reason")
        if "not-in-inventory" not in failed:
            problems.append("the unknown node is neither passed nor failed")
        if problems:
            raise RuntimeError("; ".join(problems))
        print("standalone extender in the image: filter answered as kube-scheduler expects")
        return 0
    except (RuntimeError, OSError, ValueError) as e:
        log.flush()
        sys.stderr.write(f"image smoke test failed: {e}\n{(work / 'extender.log').read_text(errors='replace')[-3000:]}")
        return 1
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
