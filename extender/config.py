"""Settings shared by every part of the extender, with the defaults of docs/contracts.md."""

from __future__ import annotations

from dataclasses import dataclass

from gputopo.contract import DEFAULT_PREFIX, DEFAULT_RESOURCE, Keys, prefix_problem

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
        problem = prefix_problem(self.annotation_prefix)
        if problem:
            raise ValueError(problem)
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
    def keys(self) -> Keys:
        return Keys(self.annotation_prefix)
