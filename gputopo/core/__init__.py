"""The pure core shared by the plugin and the extender: topology model, bandwidth estimates, scoring, allocator."""

from gputopo.core.allocator import (
    Allocation,
    allreduce_gbps,
    best_possible_gbps,
    best_subset,
    min_nvlink_gbps,
    nvlink_ring_sizes,
)
from gputopo.core.codec import (
    NodeState,
    SharedGpu,
    SharedResource,
    Sharing,
    state_from_json,
    state_to_json,
    topology_from_dict,
    topology_from_json,
    topology_to_dict,
    topology_to_json,
)
from gputopo.core.efficiency import VS_EMPTY, VS_FREE, efficiency_ratio, efficiency_vs_empty, efficiency_vs_free
from gputopo.core.errors import AllocationError, CoreError, TopologyError, TopologyFormatError, TopologyParseError
from gputopo.core.jobs import JobEstimate, JobModelError, Limit, PodSlot, job_allreduce_gbps
from gputopo.core.locality import Level, Locality, LocalityError, parse_locality
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology

__all__ = [
    "VS_EMPTY",
    "VS_FREE",
    "Allocation",
    "AllocationError",
    "CoreError",
    "Gpu",
    "JobEstimate",
    "JobModelError",
    "Level",
    "Limit",
    "Link",
    "LinkKind",
    "Locality",
    "LocalityError",
    "Nic",
    "NodeState",
    "PodSlot",
    "SharedGpu",
    "SharedResource",
    "Sharing",
    "Topology",
    "TopologyError",
    "TopologyFormatError",
    "TopologyParseError",
    "allreduce_gbps",
    "best_possible_gbps",
    "best_subset",
    "efficiency_ratio",
    "efficiency_vs_empty",
    "efficiency_vs_free",
    "job_allreduce_gbps",
    "min_nvlink_gbps",
    "nvlink_ring_sizes",
    "parse_locality",
    "state_from_json",
    "state_to_json",
    "topology_from_dict",
    "topology_from_json",
    "topology_to_dict",
    "topology_to_json",
]
