"""Job sizes from the group objects the extender watches, and the kinds it cannot see: a kind that is not installed
(or not granted) is absent, looked for once per retry period, never an error loop; one installed later is found."""

from __future__ import annotations

import kubernetes.client

from extender.membership.job import GroupKind, GroupRef
from gputopo.kube import make_api_client
from tests.extender.jobs.conftest import WAIT, cluster, pod_group
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubeapi.groups import RESOURCES, FakeGroupsKubeApi

GROUP_PATHS = ("/apis/scheduling.x-k8s.io/", "/apis/scheduling.volcano.sh/", "/apis/scheduling.k8s.io/")


def test_sizes_follow_every_group_kind(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    with cluster(groups_api) as (ext, _):
        sizes = ext.cache.groups.sizes
        groups_fake.add_group(pod_group("cosched", 4))
        groups_fake.add_group({"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
                               "metadata": {"name": "vc", "namespace": "ml"}, "spec": {"minMember": 3}})
        groups_fake.add_group({"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
                               "metadata": {"name": "pg", "namespace": "ml"},
                               "spec": {"schedulingPolicy": {"gang": {"minCount": 8}}}})
        groups_fake.add_group({"apiVersion": "scheduling.k8s.io/v1alpha1", "kind": "Workload",
                               "metadata": {"name": "wl", "namespace": "ml"},
                               "spec": {"podGroups": [{"name": "workers", "policy": {"gang": {"minCount": 2}}},
                                                      {"name": "driver", "policy": {"basic": {}}}]}})
        want = {GroupRef(GroupKind.COSCHEDULING_POD_GROUP, "ml", "cosched"): 4,
                GroupRef(GroupKind.VOLCANO_POD_GROUP, "ml", "vc"): 3,
                GroupRef(GroupKind.K8S_POD_GROUP, "ml", "pg"): 8,
                GroupRef(GroupKind.K8S_WORKLOAD, "ml", "wl", "workers"): 2}
        assert ext.cache.wait_for(lambda: sizes == want, WAIT), sizes
        groups_fake.update_group("scheduling.x-k8s.io/v1alpha1", "PodGroup", "ml", "cosched",
                                 {"spec": {"minMember": 6}})
        groups_fake.delete_group("scheduling.volcano.sh/v1beta1", "PodGroup", "ml", "vc")
        groups_fake.update_group("scheduling.k8s.io/v1alpha2", "PodGroup", "ml", "pg",
                                 {"spec": {"schedulingPolicy": {"gang": {"minCount": -1}}}})  # garbage: no size
        want = {GroupRef(GroupKind.COSCHEDULING_POD_GROUP, "ml", "cosched"): 6,
                GroupRef(GroupKind.K8S_WORKLOAD, "ml", "wl", "workers"): 2}
        assert ext.cache.wait_for(lambda: sizes == want, WAIT), sizes


def test_kinds_that_are_not_installed_are_absent_not_an_error_loop(fake: FakeKubeApi, api) -> None:
    with cluster(api, group_retry_s=300) as (ext, client):
        assert ext.sync is not None
        watchers = ext.sync.groups
        assert ext.cache.wait_for(lambda: all(w.absent == "not installed" for w in watchers), WAIT)
        assert client.get("/readyz").status_code == 200
        text = client.get("/metrics").text
    asked = [r for r in fake.requests if r.path.startswith(GROUP_PATHS)]
    assert len(asked) == len(watchers)  # one list each; the next look is the retry period (300 s) away
    assert all(w.stats.errors == 0 for w in watchers)
    assert 'reason="error"' not in text
    assert 'restarts_total{kind="podgroups.scheduling.x-k8s.io",reason="absent"} 1.0' in text


def test_a_forbidden_kind_is_absent(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    groups_fake.fail_next(1, 403, path_regex="/apis/scheduling.volcano.sh/")  # RBAC without that kind
    with cluster(groups_api, group_retry_s=300) as (ext, _):
        assert ext.sync is not None
        by_group = {w.label.split(".", 1)[1]: w for w in ext.sync.groups}
        assert ext.cache.wait_for(lambda: by_group["scheduling.volcano.sh"].absent == "forbidden", WAIT)
        assert by_group["scheduling.x-k8s.io"].absent is None


def test_a_kind_installed_later_is_found_at_the_next_look() -> None:
    with FakeGroupsKubeApi(installed=set()) as fake:
        fake.add_group(pod_group("late", 2))
        api: kubernetes.client.ApiClient = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api, group_retry_s=0.1) as (ext, _):
                assert ext.sync is not None
                assert ext.cache.wait_for(lambda: all(w.absent for w in ext.sync.groups), WAIT)
                fake.installed = set(RESOURCES)  # the CRDs applied, the alpha APIs switched on
                assert ext.cache.wait_for(
                    lambda: ext.cache.groups.sizes == {GroupRef(GroupKind.COSCHEDULING_POD_GROUP, "ml", "late"): 2},
                    WAIT)
                assert ext.cache.wait_for(lambda: not any(w.absent for w in ext.sync.groups), WAIT)
        finally:
            api.close()
