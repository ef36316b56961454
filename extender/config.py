"""Settings shared by every part of the extender, with the defaults of docs/contracts.md."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "gpu-topology.io"
DEFAULT_RESOURCE = "nvidia.com/gpu"
DEFAULT_BODY_LIMIT = 10 * 1024 * 1024
DEFAULT_RESERVATION_TIMEOUT_S = 300.0
# See extender.placement.island_values; chosen with bench/placement.py.
DEFAULT_ISLAND_PENALTY = 1.0
DEFAULT_ISLAND_SPARE = 4


@dataclass(frozen=True)
class ExtenderConfig:
    """What the verbs need to know about names on the cluster and their own limits."""

    annotation_prefix: str = DEFAULT_PREFIX
    resource_name: str = DEFAULT_RESOURCE
    reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S
    max_body_bytes: int = DEFAULT_BODY_LIMIT
    island_penalty: float = DEFAULT_ISLAND_PENALTY
    island_spare: int = DEFAULT_ISLAND_SPARE

    def __post_init__(self) -> None:
        if not self.annotation_prefix or "/" in self.annotation_prefix:
            raise ValueError(f"annotation prefix must be a DNS-style name without '/', got {self.annotation_prefix!r}")
        if not self.resource_name:
            raise ValueError("resource name must not be empty")
        if not self.reservation_timeout_s > 0:
            raise ValueError(f"reservation timeout must be positive, got {self.reservation_timeout_s}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"body size limit must be positive, got {self.max_body_bytes}")
        if not self.island_penalty >= 0:
            raise ValueError(f"island penalty must be 0 or more, got {self.island_penalty}")
        if self.island_spare < 0:
            raise ValueError(f"island spare count must be 0 or more, got {self.island_spare}")

    @property
    def topology_key(self) -> str:
        return f"{self.annotation_prefix}/topology"

    @property
    def state_key(self) -> str:
        return f"{self.annotation_prefix}/state"

    @property
    def plan_key(self) -> str:
        return f"{self.annotation_prefix}/plan"

    @property
    def gbps_key(self) -> str:
        return f"{self.annotation_prefix}/allreduce-gbps"

    @property
    def require_nvlink_key(self) -> str:
        return f"{self.annotation_prefix}/require-nvlink"

    @property
    def min_gbps_key(self) -> str:
        return f"{self.annotation_prefix}/min-allreduce-gbps"
