"""The pure core shared by the plugin and the extender: topology model, bandwidth estimates, scoring, allocator."""

from gputopo.core.allocator import Allocation, allreduce_gbps, best_possible_gbps, best_subset, placement_efficiency
from gputopo.core.codec import (
    NodeState,
    state_from_json,
    state_to_json,
    topology_from_dict,
    topology_from_json,
    topology_to_dict,
    topology_to_json,
)
from gputopo.core.errors import AllocationError, CoreError, TopologyError, TopologyFormatError, TopologyParseError
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology

__all__ = [
    "Allocation",
    "AllocationError",
    "CoreError",
    "Gpu",
    "Link",
    "LinkKind",
    "Nic",
    "NodeState",
    "Topology",
    "TopologyError",
    "TopologyFormatError",
    "TopologyParseError",
    "allreduce_gbps",
    "best_possible_gbps",
    "best_subset",
    "placement_efficiency",
    "state_from_json",
    "state_to_json",
    "topology_from_dict",
    "topology_from_json",
    "topology_to_dict",
    "topology_to_json",
]
