"""A job of unknown size holds room for its next pods, and another job's first pod waits; that hold ends with no
cluster event, so the extender touches the waiting pod for kube-scheduler to retry it (extender.requeue)."""

from __future__ import annotations

from typing import Any

import kubernetes.client

from gputopo.contract import DEFAULT_KEYS
from sim.scheduler import SchedulerDriver
from tests.extender.jobs.conftest import DGX_A100, cluster, k8s_node, kubeflow_pod, rated
from tests.helpers.polling import eventually

KEY = DEFAULT_KEYS.requeued


def test_the_first_pod_of_a_job_waiting_on_a_growing_job_is_touched_when_that_job_goes_idle(
        groups_fake: Any, groups_api: kubernetes.client.ApiClient) -> None:
    """A job of unknown size holds room on its node while it may still grow; another job's first pod waits. When
    the first job has grown no more for the reservation timeout the hold ends with no cluster event: the waiting
    pod is touched so kube-scheduler retries it."""
    now = [1000.0]
    groups_fake.add_node(k8s_node("n0", rated(DGX_A100, 100.0)))
    first = groups_fake.add_pod(kubeflow_pod("train-a", 0, 1, pod_group=False))
    waiting = groups_fake.add_pod(kubeflow_pod("train-b", 0, 4, pod_group=False))
    with cluster(groups_api, clock=lambda: now[0], reservation_timeout_s=60) as (ext, client):
        driver = SchedulerDriver(str(client.base_url), seed=1)
        try:
            assert driver.schedule(first, ["n0"]).node == "n0"
            refused = driver.schedule(waiting, ["n0"])
        finally:
            driver.close()
        assert refused.node is None, refused
        ns, name = waiting["metadata"]["namespace"], waiting["metadata"]["name"]
        assert KEY not in (groups_fake.pod(ns, name) or {})["metadata"].get("annotations", {})
        now[0] += 61
        ext.jobs.sweep()
        assert eventually(lambda: KEY in (groups_fake.pod(ns, name) or {})["metadata"].get("annotations", {}), 10)
