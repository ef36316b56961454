"""The kubelet's PodResources service for tests: the simulator's own (sim.podresources), under its old name."""

from sim.podresources import Containers, FakePodResources, PodResourcesServer

__all__ = ["Containers", "FakePodResources", "PodResourcesServer"]
