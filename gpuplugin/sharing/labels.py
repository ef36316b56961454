"""The node labels GPU Feature Discovery users select on, written by the plugin for the layout it serves.

NVIDIA's GFD derives them from the same config (internal/lm/resource.go): `nvidia.com/gpu.replicas` is the per-GPU
replica count ("1" without sharing), `nvidia.com/gpu.sharing-strategy` none | time-slicing | mps,
`nvidia.com/gpu.product` gets `-SHARED` when replicas are advertised under the unrenamed resource (a renamed one
already says it in its name), `nvidia.com/mps.capable` is true under MPS. A node here can hold several replica
counts (devices per entry): the label carries the largest. Where GFD runs it is their writer: by default (auto)
the plugin writes them only on a Node without GFD_TIMESTAMP (gpuplugin.publisher), so two writers never disagree;
--sharing-labels writes them anyway (GFD run with the same config), --no-sharing-labels never.
"""

from __future__ import annotations

from gpuplugin.sharing.layout import Layout
from gputopo.core.topology import Topology

REPLICAS = "nvidia.com/gpu.replicas"
STRATEGY = "nvidia.com/gpu.sharing-strategy"
PRODUCT = "nvidia.com/gpu.product"
MPS_CAPABLE = "nvidia.com/mps.capable"
# NVIDIA's GPU Feature Discovery stamps every Node it labels with this label (unless run with --no-timestamp):
# gpu-feature-discovery main.go, `gfdLabels["nvidia.com/gfd.timestamp"]`, and the expected labels of the
# k8s-device-plugin e2e tests, where GFD now lives. Present: GFD writes the keys above on this Node.
GFD_TIMESTAMP = "nvidia.com/gfd.timestamp"


def _label_value(text: str) -> str:
    import re

    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text.strip())[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def gfd_labels(layout: Layout, topology: Topology, whole_resource: str) -> dict[str, str | None]:
    models = {g.model for g in topology.gpus if g.model}
    product = _label_value(models.pop()) if len(models) == 1 else None
    replicas = max((n for s in layout.shared for _, n in s.replicas), default=1)
    unrenamed = any(s.name == whole_resource for s in layout.shared)
    if product and unrenamed:
        product = f"{product[:56]}-SHARED"
    return {
        REPLICAS: str(replicas),
        STRATEGY: layout.strategy or "none",
        PRODUCT: product,
        MPS_CAPABLE: "true" if layout.strategy == "mps" else "false",
    }
