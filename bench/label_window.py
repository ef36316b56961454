"""How long a new GPU node is allocatable without its topology labels: `python -m bench.label_window [--rounds 5]
[--topology FILE] [--out bench/results/label-window]`.

Why it matters: between a node's GPUs becoming allocatable and the plugin's `fabric` / `allreduce-gbps-<k>` labels,
a pod asking NVLink or a bandwidth floor (node affinity on those labels, from the webhook) does not fit the new,
ready node; an autoscaler loop in that window sees the pod still unschedulable and may add a second node.

Each round, through etcd and kube-apiserver v1.36.2 (tests/helpers/controlplane.py), one new node per mode, each
with the real `gpuplugin run` process, its kubelet simulator and the kubelet's admission of the advertised GPUs
(tests/helpers/realnode.py: the Node's `nvidia.com/gpu` allocatable appears once the plugin registered, as on a
real kubelet; the plugin's publisher labels it over the API):
- `plugin labels it`: the Node registers with the kubelet's own labels only (today's install);
- `registered with --node-labels`: the Node registers with the labels `gpuplugin node-template --format kubelet`
  prints for its topology, as a kubelet started with that flag does.
A watch on the Node, opened before it exists, stamps the first event with GPUs allocatable and the first event
with the `fabric` label; the window is the time between them while the node was allocatable without the label (0
when the label came first). Before the rounds, the same labels are sent in a dry-run create of a Node as its own
kubelet (user system:node:<name>, group system:nodes) to a kube-apiserver running NodeRestriction
(tests/helpers/node_restriction.py), with a `gpu.kubernetes.io` label as the control it must refuse.

The machine (2 shared cores) is what it is: the figures are the quiet case; the issue's "about 12 s under load"
is the same window stretched by a slower plugin start and publisher.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, SHARED, machine_line, markdown_table
from gputopo.contract import DEFAULT_KEYS
from tests.helpers.controlplane import ControlPlane, wait_until
from tests.helpers.node_restriction import node_restricted_control_plane, register_as_kubelet
from tests.helpers.realnode import real_gpu_node

GPU = "nvidia.com/gpu"
DEFAULT_TOPOLOGY = SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"
MODES = ("plugin labels it", "registered with --node-labels")
WAIT_S = 120.0  # liveness bound of one node's wait on a loaded machine, never a figure


def kubelet_labels(topology: Path) -> dict[str, str]:
    """The labels `gpuplugin node-template --format kubelet` prints, parsed back from the flag."""
    out = subprocess.run([str(Path(sys.executable).parent / "gpuplugin"), "node-template", "--topology",
                          str(topology), "--format", "kubelet"], capture_output=True, text=True, check=True)
    flag = out.stdout.strip()
    return dict(item.split("=", 1) for item in flag.removeprefix("--node-labels=").split(","))


def node_restriction_verdict(cp: ControlPlane, name: str, labels: dict[str, str]) -> tuple[int, str]:
    """A dry-run create of Node `name` by its own kubelet's identity (impersonated), with `labels`."""
    r = register_as_kubelet(cp, name, labels, dry_run=True)
    return r.status_code, (r.json().get("message", "") if r.status_code >= 300 else "")


@dataclass
class NodeWatch:
    """The first moments Node `name` was seen allocatable and labelled, from a watch opened before it exists."""

    cp: ControlPlane
    name: str
    allocatable_at: float | None = None
    labelled_at: float | None = None
    created_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> NodeWatch:
        rv = self.cp.request("GET", "/api/v1/nodes", limit=1)["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, args=(rv,), daemon=True)
        self._thread.start()
        return self

    def _run(self, rv: str) -> None:
        params = {"watch": "1", "fieldSelector": f"metadata.name={self.name}", "resourceVersion": rv,
                  "allowWatchBookmarks": "false"}
        with self.cp.new_client(timeout=None) as client, client.stream("GET", "/api/v1/nodes", params=params) as r:
            for line in r.iter_lines():
                now = time.monotonic()
                if not line:
                    continue
                obj: dict[str, Any] = json.loads(line).get("object") or {}
                self.created_at = self.created_at or now
                if self.allocatable_at is None and int((obj.get("status") or {}).get("allocatable", {})
                                                       .get(GPU, "0")) > 0:
                    self.allocatable_at = now
                labels = (obj.get("metadata") or {}).get("labels") or {}
                if self.labelled_at is None and DEFAULT_KEYS.fabric_label in labels:
                    self.labelled_at = now
                if self.done() or self._stop.is_set():
                    return

    def done(self) -> bool:
        return self.allocatable_at is not None and self.labelled_at is not None

    def window_s(self) -> float:
        """Seconds the Node was allocatable without the label (0: labelled first)."""
        assert self.allocatable_at is not None and self.labelled_at is not None
        return max(0.0, self.labelled_at - self.allocatable_at)


def one_node(cp: ControlPlane, name: str, topology: Path, labels: dict[str, str] | None) -> NodeWatch:
    watch = NodeWatch(cp, name).start()
    with real_gpu_node(cp, name, topology=topology, labels=labels):
        wait_until(f"{name} allocatable and labelled", watch.done, WAIT_S)
    return watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY)
    ap.add_argument("--out", type=Path, default=RESULTS / "label-window")
    args = ap.parse_args()

    labels = kubelet_labels(args.topology)
    windows: dict[str, list[float]] = {m: [] for m in MODES}
    leads: list[float] = []  # registered with labels: seconds the label preceded allocatable GPUs
    with node_restricted_control_plane() as cp:
        status, message = node_restriction_verdict(cp, "nr-check", labels)
        assert status == 201, f"NodeRestriction refused the labels: {message}"
        bad, bad_message = node_restriction_verdict(cp, "nr-check", {"gpu.kubernetes.io/fabric": "nvswitch"})
        assert bad == 403, f"NodeRestriction is not judging the kubelet's labels: {bad} {bad_message}"
        print(f"NodeRestriction, kubelet creating its Node with these labels: {status} "
              f"(control, a gpu.kubernetes.io label: {bad} {bad_message[:120]})")
        for i in range(args.rounds):
            for mode in MODES:
                with_labels = mode == MODES[1]
                watch = one_node(cp, f"window-{i}-{'labelled' if with_labels else 'plain'}", args.topology,
                                 labels if with_labels else None)
                windows[mode].append(watch.window_s())
                if with_labels:
                    assert watch.allocatable_at is not None and watch.labelled_at is not None
                    leads.append(watch.allocatable_at - watch.labelled_at)
                print(f"round {i} {mode}: allocatable without the fabric label for {watch.window_s():.3f} s",
                      flush=True)

    rows = [[m, len(w), f"{statistics.median(w):.3f}", f"{min(w):.3f}", f"{max(w):.3f}"] for m, w in windows.items()]
    table = markdown_table(["mode", "nodes", "median s", "min s", "max s"], rows)
    text = (f"# A new node allocatable without its topology labels\n\n`python -m bench.label_window --rounds "
            f"{args.rounds} --topology {args.topology.name}`; {machine_line()}\n\n{table}\n\n"
            f"NodeRestriction admitted the kubelet's create with the labels: HTTP {status}; a gpu.kubernetes.io "
            f"label as control: HTTP {bad}.\nRegistered with the labels, the label preceded allocatable GPUs by "
            f"{statistics.median(leads):.3f} s (median).\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"windows_s": windows, "label_lead_s": leads,
                                                         "node_restriction": [status, bad]}, indent=1))


if __name__ == "__main__":
    main()
