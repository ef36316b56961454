"""Which MIG devices of this node are advertised under which resource, per NVIDIA's `migStrategy`: a pure function
of the strategy and what NVML says now (gputopo.discovery.nvml_mig), so the re-partition loop can compare the
resources it serves with the ones the layout asks for, and tests can check every rule without a kubelet.

The strategies, as NVIDIA's plugin names them (docs/reference/gpu-sharing.md §2.1):
- `none`: MIG-enabled GPUs stay out (their slices are not whole GPUs); the reason is kept for the node.
- `single`: every MIG device is `nvidia.com/gpu`. Only on a uniform node: every GPU MIG-enabled, each with devices,
  all of one profile. A pod asking for `nvidia.com/gpu: 1` must get the same thing wherever it lands, so anything
  else is refused, naming the layout, and no MIG device is served (NVIDIA refuses such a node too).
- `mixed`: `nvidia.com/mig-<profile>` per profile (`+me` written `.me`, gputopo.core.mig.resource_for), only for
  devices whose compute instance takes the whole GPU instance (C == G); the whole GPUs stay `nvidia.com/gpu`.
Device ids are MIG UUIDs: stable across plugin restarts and what NVIDIA_VISIBLE_DEVICES takes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuplugin.deviceplugin.devices import MAX_DEVICE_ID_LENGTH
from gputopo.core.mig import MigError, resource_for
from gputopo.discovery.nvml_mig import MigDevice, MigGpu


class MigStrategy(StrEnum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


class MigStrategyError(ValueError):
    """A strategy value that is not one of NVIDIA's names (the message names the field it came from)."""


def parse_strategy(value: Any, where: str) -> MigStrategy:
    """NVIDIA's spelling (`none`, `single`, `mixed`; case-insensitive as its flag parser is)."""
    text = value.strip().lower() if isinstance(value, str) else value
    try:
        return MigStrategy(text)
    except ValueError:
        raise MigStrategyError(f"{where}: {value!r} is not a MIG strategy (none, single or mixed)") from None


def strategy_from_flags(flags: Mapping[str, Any]) -> MigStrategy | None:
    """`flags.migStrategy` of NVIDIA's config file, or None when the file does not set it."""
    value = flags.get("migStrategy")
    return None if value is None else parse_strategy(value, "flags.migStrategy")


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG device as served: the device and its parent GPU (what Allocate and health need)."""

    device: MigDevice
    gpu_uuid: str
    nvml_index: int
    minor: int | None

    @property
    def uuid(self) -> str:
        return self.device.uuid


@dataclass(frozen=True)
class MigPlan:
    """What a strategy serves on a MIG layout: resource -> instances (MIG UUID order), why MIG devices are left out
    (GPU or MIG UUID -> reason), and the refusal of the strategy as a whole (single on a non-uniform node)."""

    strategy: MigStrategy
    resources: Mapping[str, tuple[MigInstance, ...]] = field(default_factory=dict)
    left_out: Mapping[str, str] = field(default_factory=dict)
    refused: str | None = None

    def ids(self) -> dict[str, set[str]]:
        return {name: {i.uuid for i in insts} for name, insts in self.resources.items()}

    def counts(self) -> dict[str, int]:
        return {name: len(insts) for name, insts in sorted(self.resources.items())}


def layout_text(gpus: Sequence[MigGpu]) -> str:
    """`GPU-a: 7x 1g.10gb; GPU-b: 2x 1g.10gb, 1x 2g.20gb` for a refusal a person can act on."""
    parts = []
    for g in gpus:
        names = Counter(d.name or "unknown profile" for d in g.devices)
        inside = ", ".join(f"{n}x {name}" for name, n in sorted(names.items())) or "no MIG devices"
        parts.append(f"{g.uuid}: {inside}")
    return "; ".join(parts)


def _instances(g: MigGpu) -> list[MigInstance]:
    return [MigInstance(d, g.uuid, g.nvml_index, g.minor) for d in g.devices]


def _single_problem(enabled: Sequence[MigGpu], whole_gpus: int) -> str | None:
    if whole_gpus:
        return (f"the single MIG strategy needs every GPU MIG-enabled, and {whole_gpus} GPU(s) of this node are not "
                f"(MIG GPUs: {layout_text(enabled)}); use mixed, or partition every GPU")
    empty = [g.uuid for g in enabled if not g.devices]
    if empty:
        return f"the single MIG strategy needs MIG devices on every MIG GPU; {', '.join(empty)} has none"
    names = {d.name for g in enabled for d in g.devices}
    if None in names:
        return f"the single MIG strategy cannot serve devices of an unknown profile ({layout_text(enabled)})"
    if len(names) > 1:
        return (f"the single MIG strategy needs one MIG profile on the whole node; it is not uniform "
                f"({layout_text(enabled)}); use mixed, or partition every GPU alike")
    return None


def plan_mig(strategy: MigStrategy, gpus: Sequence[MigGpu], whole_gpus: int, whole_resource: str) -> MigPlan:
    """What `strategy` advertises of `gpus` (MIG facts of the node's MIG GPUs) beside `whole_gpus` whole GPUs
    served as `whole_resource`. GPUs whose MIG mode is only pending are whole GPUs now and are not looked at."""
    enabled = [g for g in gpus if g.enabled]
    if not enabled:
        return MigPlan(strategy)
    if strategy is MigStrategy.NONE:
        return MigPlan(strategy, left_out={g.uuid: "MIG enabled; the none MIG strategy leaves MIG GPUs out (set "
                                                   "mig-strategy single or mixed to serve their instances)"
                                           for g in enabled})
    left: dict[str, str] = {}
    for g in enabled:
        for d in g.devices:
            if len(d.uuid) > MAX_DEVICE_ID_LENGTH:
                left[d.uuid] = f"MIG UUID longer than the kubelet's {MAX_DEVICE_ID_LENGTH}-character device id"
    if strategy is MigStrategy.SINGLE:
        problem = _single_problem(enabled, whole_gpus)
        if problem is not None:
            return MigPlan(strategy, left_out={g.uuid: "refused: " + problem for g in enabled}, refused=problem)
        served = tuple(sorted((i for g in enabled for i in _instances(g) if i.uuid not in left),
                              key=lambda i: i.uuid))
        return MigPlan(strategy, {whole_resource: served} if served else {}, left)
    domain = whole_resource.split("/", 1)[0] if "/" in whole_resource else "nvidia.com"
    per: dict[str, list[MigInstance]] = {}
    for g in enabled:
        for inst in _instances(g):
            d = inst.device
            if inst.uuid in left:
                continue
            if d.name is None:
                left[d.uuid] = "profile unknown (NVML did not say); not advertised under a guessed name"
                continue
            if not d.advertised_by_mixed:
                left[d.uuid] = (f"{d.name} is a compute-instance sub-profile; NVIDIA's mixed strategy advertises "
                                "no resource for it")
                continue
            try:
                name = f"{domain}/{resource_for(d.name)}"
            except MigError as e:
                left[d.uuid] = str(e)
                continue
            per.setdefault(name, []).append(inst)
    resources = {name: tuple(sorted(insts, key=lambda i: i.uuid)) for name, insts in sorted(per.items())}
    return MigPlan(strategy, resources, left)
