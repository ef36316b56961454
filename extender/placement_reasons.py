"""The words of placement: why a node cannot take a pod, as kube-scheduler shows it to the user.

Filter's FailedNodes / FailedAndUnresolvableNodes and bind's errors quote these strings; they are kept in one place
so each reason reads the same wherever it surfaces, and so the policy's arithmetic stays free of formatting.
"""

from __future__ import annotations

from gputopo.core.bitset import bits

UNKNOWN_NODE = "unknown to the GPU extender (no such Node seen)"
NO_TOPOLOGY = "publishes no GPU topology"
DOES_NOT_FIT = "does not fit"


class Failed(str):
    """Filter reason of a node that cannot take the pod now; evicting pods there could change that."""


class Unresolvable(str):
    """Filter reason of a node that no preemption can make fit (FailedAndUnresolvableNodes)."""


def gpu_list(mask: int) -> str:
    """GPU indices as ranges: 0-3,6."""
    idx = bits(mask)
    parts = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}" if j > i + 1 else f"{idx[i]},{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _gbps(gbps: float) -> str:
    return f"{gbps:.1f} GB/s"


def too_few_in_total(size: int, total: int) -> str:
    return f"needs {size} GPUs, node has {total} in total"


def too_few_free(size: int, free_count: int) -> str:
    return f"needs {size} GPUs, {free_count} free"


def shortfall(used: int, unhealthy: int, reserved: int, free: int, size: int) -> str:
    """'needs 4 GPUs, 2 free: GPU 0,1 in use, GPU 5 unhealthy'."""
    parts = []
    if used:
        parts.append(f"GPU {gpu_list(used)} in use")
    bad = unhealthy & ~used
    if bad:
        parts.append(f"GPU {gpu_list(bad)} unhealthy")
    if reserved:
        parts.append(f"GPU {gpu_list(reserved)} reserved for pods being bound")
    return f"needs {size} GPU{'s' if size != 1 else ''}, {free.bit_count()} free" + (
        ": " + ", ".join(parts) if parts else "")


def no_nvlink(fabric: str) -> str:
    return f"requires NVLink: this node's GPUs have no NVLink ({fabric})"


def no_nvlink_ring(size: int, best_empty_gbps: float) -> str:
    return (f"requires an NVLink ring of {size} GPUs: none exists on this node "
            f"(best {_gbps(best_empty_gbps)} even when empty)")


def nvlink_ring_taken(size: int, chosen: int, gbps: float) -> str:
    return (f"requires an NVLink ring of {size} GPUs: the best free ones (GPU {gpu_list(chosen)}) "
            f"reach {_gbps(gbps)} over PCIe")


def too_slow_ever(min_gbps: float, size: int, best_empty_gbps: float) -> str:
    return (f"requires {_gbps(min_gbps)} all-reduce over {size} GPUs: this node's best is "
            f"{_gbps(best_empty_gbps)} even when empty")


def too_slow_now(min_gbps: float, size: int, gbps: float) -> str:
    return f"requires {_gbps(min_gbps)} all-reduce over {size} GPUs: the best free ones reach {_gbps(gbps)}"
