"""What a ResourceClaim asks of this node: its allocation results for our driver, checked against the devices the
node publishes, and its opaque configuration for our driver. Pure: the claim is a dict as the apiserver returns it.

Opaque parameters (DeviceClass or claim `config[].opaque` with our driver) must be a GpuConfig:
    {"apiVersion": "<driver>/v1alpha1", "kind": "GpuConfig", "env": {"NAME": "value", ...}}
`env` reaches the containers that get the devices (through the CDI spec); anything else is refused with a message
naming the field, so a typo never passes silently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuplugin.dra.errors import ClaimError
from gpuplugin.dra.partitions import Consumed, consumed, share_id

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ENV = 32
MAX_RESULTS = 32  # allocated devices per claim (docs/reference/dra-api.md §5)


@dataclass(frozen=True)
class Result:
    request: str  # top-level request name ("r" of "r/sub")
    device: str
    share_id: str | None = None  # shared GPUs only
    consumed: Consumed | None = None  # shared GPUs only: what the result takes of the device's capacity


class GpuConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    apiVersion: str
    kind: Literal["GpuConfig"]
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV)

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not _ENV_NAME.match(k) or k.startswith("NVIDIA_")]
        if bad:
            raise ValueError(f"environment names must be C identifiers and not NVIDIA_*: {bad[:4]}")
        return env


def claim_ref(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"


def our_results(claim: Mapping[str, Any], uid: str, driver: str, pool: str, known: Mapping[str, Any]) -> list[Result]:
    """The allocation results of `claim` for `driver`, each a device of `pool` in `known`. Raises ClaimError."""
    where = claim_ref(claim)
    meta = claim.get("metadata") or {}
    if meta.get("uid") != uid:
        raise ClaimError(f"claim {where} has UID {meta.get('uid')!r}, the kubelet asked for {uid!r} "
                         "(deleted and created again?)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"claim {where} is not allocated")
    results = (allocation.get("devices") or {}).get("results")
    if not isinstance(results, list):
        raise ClaimError(f"claim {where}: status.allocation.devices.results is missing")
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"claim {where} has {len(results)} allocation results; the API allows {MAX_RESULTS}")
    out = []
    for r in results:
        if not isinstance(r, Mapping) or r.get("driver") != driver:
            continue
        device = r.get("device")
        if r.get("pool") != pool:
            raise ClaimError(f"claim {where} is allocated device {r.get('pool')}/{device} of another pool; "
                             f"this node's pool is {pool}")
        if device not in known:
            raise ClaimError(f"claim {where} is allocated device {str(device)[:80]!r}, which node {pool} does not "
                             "have (a MIG instance destroyed since, a GPU no longer shared, or another node's)")
        request = str(r.get("request", "")).split("/")[0]
        target = known[device]
        if not getattr(target, "multi", False):
            if r.get("shareID") is not None or r.get("consumedCapacity") is not None:
                raise ClaimError(f"claim {where}: device {device} is not shared, yet its result carries a shareID "
                                 "or consumedCapacity")
            out.append(Result(request, device))
            continue
        try:
            out.append(Result(request, device, share_id(r, f"claim {where}"),
                              consumed(target, r, f"claim {where}", driver)))
        except ValueError as e:
            raise ClaimError(str(e)) from None
    if not out:
        raise ClaimError(f"claim {where} has no device of driver {driver}")
    return out


def allocated_here(claim: Mapping[str, Any], driver: str, pool: str) -> frozenset[str]:
    """Names of the devices of `driver`'s `pool` in the claim's status.allocation (empty when it has none): what
    the scheduler handed out on this node, before the kubelet asks to prepare it. Never raises: most claims a
    cluster-wide watch sees are other nodes' or malformed for our purposes, and they only do not count here."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return frozenset()
    return frozenset(str(r["device"]) for r in results if isinstance(r, Mapping) and r.get("driver") == driver
                     and r.get("pool") == pool and isinstance(r.get("device"), str))


def our_config(claim: Mapping[str, Any], driver: str) -> dict[str, str]:
    """The environment from every opaque config for `driver` (class configs first, as allocated). Raises
    ClaimError naming the config entry and field that is wrong."""
    where = claim_ref(claim)
    configs = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("config") or []
    env: dict[str, str] = {}
    for i, entry in enumerate(configs):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        try:
            config = GpuConfig.model_validate(opaque.get("parameters"))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'parameters'}: {err['msg']}"
                                 for err in e.errors()[:4])
            raise ClaimError(f"claim {where}: opaque config {i} for {driver} is malformed: {problems}") from None
        if config.apiVersion != f"{driver}/v1alpha1":
            raise ClaimError(f"claim {where}: opaque config {i} has apiVersion {config.apiVersion!r}, "
                             f"expected {driver}/v1alpha1")
        env.update(config.env)
    return env
