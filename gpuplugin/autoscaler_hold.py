"""Keeps node autoscalers from removing a busy GPU node whose GPU request ratio they misread.

The Cluster Autoscaler judges a GPU node by `nvidia.com/gpu` requests / allocatable and removes it below 0.5 for
10 minutes; Karpenter consolidates under-used nodes (docs/reference/autoscaling.md 1.5, 1.7, 2). That ratio is
wrong whenever a GPU is not one `nvidia.com/gpu`: renamed time-slicing/MPS replicas (`nvidia.com/gpu.shared`) are
invisible to it, unrenamed replicas each count as a GPU, and MIG instances are `nvidia.com/mig-*` (mixed) or count
as GPUs (single). So on such a node (sharing or MIG in effect) the plugin, which knows which physical GPUs are
held, sets both autoscalers' "do not remove" annotations while the share of physical GPUs in use is at or above a
threshold, and removes them when it falls below.

Other people set those annotations too (a maintenance hold, a pinned node). The plugin removes only what it set
itself: the annotation `<prefix>/autoscaler-hold` lists, comma-separated, the autoscaler annotations it set, and
an annotation already present (with "true" or any other value) when the hold began is never claimed, changed or
removed. The decision is a pure function of the node state and the annotations the Node carries, so a restarted
plugin picks up where it left off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gputopo.contract import CA_GPU_UTILIZATION_THRESHOLD, CA_SCALE_DOWN_DISABLED, KARPENTER_DO_NOT_DISRUPT, Keys
from gputopo.core.codec import NodeState

# The annotations each autoscaler reads as "do not remove this node voluntarily", with the value both want.
HOLD_ANNOTATIONS = (CA_SCALE_DOWN_DISABLED, KARPENTER_DO_NOT_DISRUPT)
HOLD_VALUE = "true"
DEFAULT_THRESHOLD = CA_GPU_UTILIZATION_THRESHOLD
# MIG strategies under which CA's ratio misreads: `none` advertises no MIG device, so nothing of MIG is counted.
_MISREAD_MIG_STRATEGIES = ("single", "mixed")


@dataclass(frozen=True)
class GpuUsage:
    """Physical GPUs of the node and how many of them any pod holds (a replica, a MIG instance or the GPU)."""

    busy: int
    total: int
    misread: bool  # sharing or MIG in effect: CA's own GPU ratio does not count physical GPUs

    @property
    def share(self) -> float:
        return self.busy / self.total if self.total else 0.0


def gpu_usage(state: NodeState, whole_ids: Iterable[str]) -> GpuUsage:
    """Physical GPU use from what the plugin publishes: `whole_ids` are the node's non-MIG GPUs (its topology),
    `state.used` the ones held whole, `state.sharing` the replicas held per shared GPU, `state.mig` the instances
    held per MIG GPU."""
    gpus = set(whole_ids)
    busy = set(state.used) & gpus
    shared = False
    if state.sharing is not None:
        for resource in state.sharing.resources:
            for g in resource.gpus:
                shared = True
                gpus.add(g.gpu)
                if g.used > 0:
                    busy.add(g.gpu)
    mig_in_effect = False
    if state.mig is not None:
        mig_in_effect = state.mig.strategy in _MISREAD_MIG_STRATEGIES and bool(state.mig.gpus)
        for m in state.mig.gpus:
            gpus.add(m.gpu)
            if any(i.used for i in m.instances):
                busy.add(m.gpu)
    return GpuUsage(len(busy), len(gpus), shared or mig_in_effect)


def parse_owned(value: str | None) -> frozenset[str]:
    """The autoscaler annotations our ownership annotation lists (unknown names ignored: never ours to touch)."""
    if not value:
        return frozenset()
    return frozenset(k.strip() for k in value.split(",") if k.strip() in HOLD_ANNOTATIONS)


def release(owner_key: str, annotations: Mapping[str, str]) -> dict[str, None]:
    """The annotations that end the hold this plugin set (uninstall, opt-out): what `desired` removes when no hold
    is wanted, among those the Node carries (the ownership annotation, and each autoscaler annotation it lists that
    still has our value; one another value was given since is someone else's)."""
    lifted = _desired(False, owner_key, annotations)
    return {k: None for k, v in lifted.items() if v is None and k in annotations}


def _desired(hold: bool, owner_key: str, observed: Mapping[str, str | None]) -> dict[str, str | None]:
    owned = parse_owned(observed.get(owner_key))
    out: dict[str, str | None] = {}
    now_owned: list[str] = []
    for key in HOLD_ANNOTATIONS:
        current = observed.get(key)
        mine = key in owned and current == HOLD_VALUE  # another value: someone changed it, no longer ours
        if hold and (current is None or mine):
            out[key] = HOLD_VALUE
            now_owned.append(key)
        elif mine:
            out[key] = None
        else:
            out[key] = current
    out[owner_key] = ",".join(now_owned) or None
    return out


class AutoscalerHold:
    """The hold's desired annotations for one node. `threshold` 0 turns the hold off (and lifts one we set)."""

    def __init__(self, keys: Keys, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"autoscaler busy threshold {threshold} must be from 0 to 1 (0: off)")
        self.threshold = threshold
        self.owner_key = keys.autoscaler_hold

    @property
    def annotation_keys(self) -> tuple[str, ...]:
        """Every annotation the hold reads and may write."""
        return (*HOLD_ANNOTATIONS, self.owner_key)

    def wanted(self, usage: GpuUsage) -> bool:
        return self.threshold > 0 and usage.misread and usage.total > 0 and usage.share >= self.threshold

    def desired(self, usage: GpuUsage, observed: Mapping[str, str | None]) -> dict[str, str | None]:
        """The values `annotation_keys` should have (None: absent), given what the Node carries now. An
        annotation someone else set is left as it is; ours is set while wanted and removed when not."""
        return _desired(self.wanted(usage), self.owner_key, observed)
