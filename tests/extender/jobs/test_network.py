"""A job spanning nodes gets GPUs with an RDMA NIC on their own PCIe switch (GPUDirect), where a pod placed on its
own merits would not look at NICs at all."""

from __future__ import annotations

from gputopo.contract import parse_plan
from gputopo.core import Topology
from gputopo.core.jobs import PodSlot, job_allreduce_gbps
from sim.scheduler import SchedulerDriver
from tests.extender.jobs.conftest import DGX_A100, PREFIX, WAIT, cluster, k8s_node, kubeflow_pod, pod_group, rated
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi


def one_nic_near(gpus: tuple[int, int], gbit: float) -> Topology:
    """The DGX A100 with only the 400 Gb/s NIC on the PCIe switch of `gpus` left (the others unplugged)."""
    t = rated(DGX_A100, gbit)
    nic = next(n for n in t.nics if all(n.gpu_links[g].name == "PXB" for g in gpus))
    return Topology.build(t.gpus, t.links, [nic], t.pcie_generation, t.socket_link_gbps)


def test_pods_of_a_job_across_nodes_take_the_gpus_next_to_the_nic(groups_fake: FakeGroupsKubeApi,
                                                                    groups_api) -> None:
    t = one_nic_near((6, 7), 400.0)
    assert t.network_gbps[6] == t.network_gbps[7] == 50.0 and max(t.network_gbps[:6]) < 25.8
    for name in ("n1", "n2"):
        groups_fake.add_node(k8s_node(name, t, rack="r1"))
    groups_fake.add_group(pod_group("allreduce", 2))
    pods = [groups_fake.add_pod(kubeflow_pod("allreduce", i, 2)) for i in range(2)]
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        driver = SchedulerDriver(str(client.base_url), seed=1)
        try:
            nodes = [driver.schedule(p, ["n1", "n2"]).node for p in pods]
        finally:
            driver.close()
        # 50 GB/s between nodes through GPUDirect beats the 25.8 GB/s host path between two pods of one node
        assert sorted(nodes) == ["n1", "n2"]
        slots = []
        for p, node in zip(pods, nodes, strict=True):
            plan = parse_plan(groups_fake.pod("ml", p["metadata"]["name"])["metadata"]["annotations"][f"{PREFIX}/plan"])
            assert plan.node == node and plan.ids == {"GPU6", "GPU7"}
            slots.append(PodSlot(node, t, (6, 7), ext.cache.nodes[node].place))
        assert job_allreduce_gbps(slots, ext.cache.locality).gbps == 50.0
