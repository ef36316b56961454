"""The node labels GPU Feature Discovery users select on, written by the plugin for the layout it serves.

NVIDIA's GFD derives them from the same config (internal/lm/resource.go): `nvidia.com/gpu.replicas` is the per-GPU
replica count ("1" without sharing), `nvidia.com/gpu.sharing-strategy` none | time-slicing | mps,
`nvidia.com/gpu.product` gets `-SHARED` when replicas are advertised under the unrenamed resource (a renamed one
already says it in its name), `nvidia.com/mps.capable` is true under MPS. A node here can hold several replica
counts (devices per entry): the label carries the largest. Run GFD with the same config, or turn these off
(--no-sharing-labels), so two writers do not disagree.
"""

from __future__ import annotations

from gpuplugin.sharing.layout import Layout
from gputopo.core.topology import Topology

REPLICAS = "nvidia.com/gpu.replicas"
STRATEGY = "nvidia.com/gpu.sharing-strategy"
PRODUCT = "nvidia.com/gpu.product"
MPS_CAPABLE = "nvidia.com/mps.capable"


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
