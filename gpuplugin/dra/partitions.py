"""The DRA devices that are parts of a GPU: shared GPUs (consumable capacity, KEP-5075) and existing MIG instances
(static partitions). Pure: built from the sharing layout (gpuplugin.sharing.layout) and MIG discovery
(gputopo.discovery.nvml_mig), checked against the resource.k8s.io/v1 validation rules (docs/reference/dra-api.md §5
and the apiserver's validation of capacity request policies).

**Shared GPU** (`shared-<i>`, i the topology index): one device with `allowMultipleAllocations: true` and two
capacities whose unit is one share (what the device plugin calls a replica):
- `replicas`: value R, requestPolicy default 1, validRange 1..R step 1 (1..1 under the config's
  failRequestsGreaterThanOne, NVIDIA's default for MPS: a request for more is then not allocatable, where the device
  plugin refuses it in Allocate);
- `memory`: value R x (the GPU's memory / R), requestPolicy default one share, validRange one share..as many shares
  as replicas may be asked, step one share. A request that names no capacity consumes the defaults, one share of
  each, so R claims fit by default.
The apiserver rejects a requestPolicy without allowMultipleAllocations, validValues together with validRange, a
default outside the range, a max or min above the value, and a range not a whole number of steps from min: the
shapes here keep every one of those rules (`check_capacity` states them, tests hold every published device to it).
A claim holds max(replicas, memory / share) shares; prepare gives it what the device plugin's Allocate gives for
that many replicas of the GPU (gpuplugin.sharing.mps.MpsShare.client under MPS; time-slicing adds nothing).

**MIG instance** (`mig-<nvml index>-<gi>-<ci>`): one device per existing MIG device (GPU instance + compute
instance), with the attributes NVIDIA's DRA driver gives its MIG devices (profile, placement, parent, memory, MIG
UUID; docs/reference/gpu-sharing.md §4.2) and its memory and multiprocessors as plain capacities. The name spells
the instance's ids, so a re-created instance with other ids is another device. A device whose profile or placement
NVML would not tell is left out (logged by the caller): no class could select it by profile.

Both carry `size` 1 and an `order` ("shared", "mig") as the whole-GPU devices do: the whole-GPU classes test
`size == 1 && order == "rings"`, and a device lacking an attribute a selector reads is a CEL runtime error for the
scheduler, which fails the claim instead of skipping the device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from gpuplugin.dra.catalog import MIG, SHARED, Device, parse_device_name
from gpuplugin.sharing.layout import Layout
from gpuplugin.sharing.mps import MpsGpu, MpsShare
from gputopo.core.topology import Topology
from gputopo.discovery.nvml_mig import MigGpu
from gputopo.quantity import QuantityError, parse_quantity

REPLICAS = "replicas"
MEMORY = "memory"
MULTIPROCESSORS = "multiprocessors"
MIB = 1 << 20
_UUID = re.compile(r"^[0-9a-fA-F-]{1,64}$")  # shareID: the scheduler writes a UUID


class CapacityError(ValueError):
    """A capacity or its request policy the apiserver would refuse; the message names the rule."""


def shared_name(gpu: int) -> str:
    return f"{SHARED}-{gpu}"


def mig_name(nvml_index: int, gi: int, ci: int) -> str:
    return f"{MIG}-{nvml_index}-{gi}-{ci}"


def _range_policy(default: int, low: int, high: int, step: int, unit: str = "") -> dict[str, Any]:
    return {"default": f"{default}{unit}",
            "validRange": {"min": f"{low}{unit}", "max": f"{high}{unit}", "step": f"{step}{unit}"}}


def shared_device(topology: Topology, gpu: int, replicas: int, strategy: str, at_most_one: bool = False) -> Device:
    """The one device of GPU `gpu` (topology index) shared `replicas` ways; `at_most_one`: one replica per request
    (failRequestsGreaterThanOne)."""
    g = topology.gpus[gpu]
    share = g.memory_mib // replicas if g.memory_mib else None
    most = 1 if at_most_one else replicas
    capacity: dict[str, Any] = {REPLICAS: {"value": str(replicas), "requestPolicy": _range_policy(1, 1, most, 1)}}
    if share:
        capacity[MEMORY] = {"value": f"{share * replicas}Mi",
                            "requestPolicy": _range_policy(share, share, share * most, share, "Mi")}
    attributes: dict[str, Any] = {
        "size": {"int": 1},
        "order": {"string": SHARED},
        "uuid": {"string": g.id[:64]},
        "sharing": {"string": strategy},
    }
    if g.model:
        attributes["model"] = {"string": g.model[:64]}
    for key, value in capacity.items():
        check_capacity(key, value, multi=True)
    return Device(name=shared_name(gpu), gpus=(gpu,), group=SHARED, ring_gbps=0.0, total_gbps=0.0,
                  numa_nodes=1, nvlink_island=False, attributes=attributes, capacity=capacity, multi=True,
                  uuid=g.id, replicas=replicas, share_mib=share, strategy=strategy)


def shared_devices(topology: Topology, layout: Layout) -> list[Device]:
    """One device per GPU the layout shares, in topology order."""
    out = [shared_device(topology, gpu, n, s.strategy, s.fail_requests_greater_than_one)
           for s in layout.shared for gpu, n in s.replicas]
    return sorted(out, key=lambda d: d.gpus)


def mig_devices(gpus: Sequence[MigGpu]) -> tuple[list[Device], list[str]]:
    """(devices, why each left-out MIG device is left out) for the MIG-enabled GPUs' existing instances."""
    out: list[Device] = []
    skipped: list[str] = []
    for gpu in gpus:
        if not gpu.enabled:
            continue
        for d in gpu.devices:
            if d.profile is None or d.placement is None or d.name is None:
                skipped.append(f"{d.uuid}: NVML did not tell its profile or placement")
                continue
            attributes: dict[str, Any] = {
                "size": {"int": 1},
                "order": {"string": MIG},
                "type": {"string": "mig"},
                "profile": {"string": d.name},
                "giProfile": {"string": d.profile.name},
                "uuid": {"string": d.uuid[:64]},
                "parentUUID": {"string": gpu.uuid[:64]},
                "parentIndex": {"int": gpu.nvml_index},
                "placementStart": {"int": d.placement.start},
                "placementSize": {"int": d.placement.size},
                "gpuInstance": {"int": d.gpu_instance_id},
                "computeInstance": {"int": d.compute_instance_id},
            }
            if gpu.minor is not None:
                attributes["parentMinor"] = {"int": gpu.minor}
            if gpu.model:
                attributes["model"] = {"string": gpu.model[:64]}
            capacity: dict[str, Any] = {MEMORY: {"value": str(d.memory_bytes)}}
            if d.profile.multiprocessors:
                capacity[MULTIPROCESSORS] = {"value": str(d.profile.multiprocessors)}
            out.append(Device(name=mig_name(gpu.nvml_index, d.gpu_instance_id, d.compute_instance_id), gpus=(),
                              group=MIG, ring_gbps=0.0, total_gbps=0.0, numa_nodes=1, nvlink_island=False,
                              attributes=attributes, capacity=capacity, uuid=d.uuid,
                              device_nodes=tuple(d.device_nodes)))
    return out, skipped


def gpus_to_share(layout: Layout, held: Iterable[str]) -> tuple[dict[int, int], list[int]]:
    """(GPU -> replicas to share now, GPUs the layout shares but a prepared claim holds whole): a GPU held as a
    whole device (`gpu-3`, a set) stays whole until that claim ends, so no GPU is ever offered both ways."""
    wanted = {gpu: n for s in layout.shared for gpu, n in s.replicas}
    whole_held = {g for name in held if (members := parse_device_name(name)) for g in members}
    deferred = sorted(set(wanted) & whole_held)
    return {g: n for g, n in wanted.items() if g not in whole_held}, deferred


# ---- the apiserver's rules for a capacity (validation.go: validateMultiAllocatableDeviceCapacity & co.) ----


def check_capacity(name: str, capacity: Mapping[str, Any], *, multi: bool) -> None:
    """Raise CapacityError for a capacity the apiserver would refuse."""
    value = _q(capacity.get("value"), f"{name}.value")
    policy = capacity.get("requestPolicy")
    if policy is None:
        return
    if not multi:
        raise CapacityError(f"{name}.requestPolicy: Forbidden: allowMultipleAllocations must be true")
    values, rng = policy.get("validValues"), policy.get("validRange")
    if values and rng is not None:
        raise CapacityError(f"{name}.requestPolicy: Forbidden: cannot specify validValues and validRange at once")
    if not values and rng is None:
        return
    if policy.get("default") is None:
        raise CapacityError(f"{name}.requestPolicy.default: Required when validValues or validRange is set")
    default = _q(policy["default"], f"{name}.requestPolicy.default")
    if values:
        qs = [_q(v, f"{name}.requestPolicy.validValues") for v in values]
        if len(qs) > 10 or qs != sorted(qs) or any(v > value for v in qs) or default not in qs:
            raise CapacityError(f"{name}.requestPolicy.validValues: at most 10, ascending, within the value, "
                                "holding the default")
        return
    low = _q(rng.get("min"), f"{name}.requestPolicy.validRange.min")
    high = _q(rng["max"], "max") if rng.get("max") is not None else None
    step = _q(rng["step"], "step") if rng.get("step") is not None else None
    problems = [low > value and "min is larger than the value", default < low and "default is less than min"]
    if high is not None:
        problems += [low > high and "min is larger than max", high > value and "max is larger than the value",
                     default > high and "default is more than max"]
    if step is not None:
        problems += [low + step > value and "one step from min is larger than the value",
                     (default - low) % step != 0 and "default is not a whole number of steps from min",
                     high is not None and (high - low) % step != 0 and "max is not a whole number of steps from min"]
    bad = [p for p in problems if p]
    if bad:
        raise CapacityError(f"{name}.requestPolicy.validRange: {'; '.join(bad)}")


def _q(text: Any, where: str) -> Decimal:
    if not isinstance(text, str):
        raise CapacityError(f"{where}: {text!r} is not a quantity string")
    try:
        return parse_quantity(text)
    except QuantityError as e:
        raise CapacityError(f"{where}: {e}") from None


# ---- what a claim's allocation result consumes of a shared GPU ----


@dataclass(frozen=True)
class Consumed:
    """One allocation result's share of a shared GPU: its replicas and memory (MiB) as the scheduler wrote them
    in `consumedCapacity`, or the policy defaults when it wrote none."""

    replicas: int
    memory_mib: int

    def shares(self, share_mib: int | None) -> int:
        """How many replicas' worth the container gets: the larger of what it asked in replicas and in memory."""
        by_memory = -(-self.memory_mib // share_mib) if share_mib else 0
        return max(self.replicas, by_memory, 1)


def consumed(device: Device, result: Mapping[str, Any], where: str, domain: str) -> Consumed:
    """Parse a result's `consumedCapacity` for shared `device` (names plain or qualified by the driver's `domain`);
    raise ValueError naming what is wrong (the caller wraps it in its ClaimError)."""
    raw = result.get("consumedCapacity")
    share = device.share_mib or 0
    if raw is None:
        return Consumed(1, share)
    if not isinstance(raw, Mapping) or len(raw) > 32:
        raise ValueError(f"{where}: consumedCapacity must be a map of at most 32 capacities, got {str(raw)[:80]}")
    raw = {str(k).removeprefix(f"{domain}/"): v for k, v in raw.items()}
    unknown = sorted(str(k) for k in raw if k not in device.capacity)
    if unknown:
        raise ValueError(f"{where}: consumedCapacity names {unknown[:4]}, which device {device.name} does not have "
                         f"(it has {sorted(device.capacity)})")
    try:
        replicas = parse_quantity(str(raw.get(REPLICAS, "1")))
        memory = parse_quantity(str(raw[MEMORY])) / MIB if MEMORY in raw else Decimal(share)
    except QuantityError as e:
        raise ValueError(f"{where}: consumedCapacity: {e}") from None
    most = per_request_most(device)
    if replicas != replicas.to_integral_value() or not 1 <= replicas <= most:
        raise ValueError(f"{where}: consumedCapacity replicas {raw.get(REPLICAS)} is not a whole number from 1 to "
                         f"{most} (device {device.name})")
    total = most * share
    if memory < 0 or (share and memory > total):
        raise ValueError(f"{where}: consumedCapacity memory {raw.get(MEMORY)} is beyond the {total}Mi one request "
                         f"may take of device {device.name}")
    return Consumed(int(replicas), int(memory.to_integral_value()))


def per_request_most(device: Device) -> int:
    """The most replicas one request may take of a shared device: its replicas policy's max."""
    return int(parse_quantity(device.capacity[REPLICAS]["requestPolicy"]["validRange"]["max"]))


def share_id(result: Mapping[str, Any], where: str) -> str | None:
    """The result's shareID (None when the scheduler wrote none); raise ValueError for one that is not a UUID."""
    value = result.get("shareID")
    if value is None:
        return None
    if not isinstance(value, str) or not _UUID.match(value):
        raise ValueError(f"{where}: shareID {str(value)[:80]!r} is not a UUID")
    return value


def mps_shares(topology: Topology, layout: Layout, gpus: Iterable[int], root: Path) -> dict[str, MpsShare]:
    """GPU UUID -> the MPS share (daemon directories, per-client limits) of each shared GPU in `gpus` that its set
    serves through MPS: one share per shared set, laid out as the device plugin lays it out (gpuplugin.sharing)."""
    chosen = set(gpus)
    by_index = {g.index: g for g in topology.gpus}
    out: dict[str, MpsShare] = {}
    for s in layout.shared:
        replicas = [(i, n) for i, n in s.replicas if i in chosen]
        if s.strategy != "mps" or not replicas:
            continue
        # A claim may take several shares of one GPU (capacity `replicas` > 1) unless failRequestsGreaterThanOne: the
        # daemon's defaults must allow that much, since a client's env can only lower them.
        share = MpsShare(s.name, root, tuple(MpsGpu(by_index[i].id, n, by_index[i].memory_mib) for i, n in replicas),
                         several_per_client=not s.fail_requests_greater_than_one)
        out.update({g.uuid: share for g in share.gpus})
    return out
