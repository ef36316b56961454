"""deploy/rbac-calls.yaml is what the code really calls: the real plugin and extender processes run against the
in-process kube-apiserver through every path that talks to it, each recorded request is turned into the
(verb, API group, resource, subresource) the apiserver's RBAC authorizer checks, and the set per component must
equal the table: every call the code makes is declared (so granted, by tests/deploy/test_rbac.py), and nothing is
declared that the code never makes.

kube-scheduler's entries (its Lease) belong to the upstream binary, which does not run here: they are left to the
static test, which checks them against the KubeSchedulerConfiguration's leader election.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import yaml

from gputopo.core import state_from_json
from sim.ports import free_port
from tests.deploy.rendering import DEPLOY
from tests.extender.conftest import topo
from tests.fakes.gpunode import GpuNode, gpu_node
from tests.fakes.kubeapi import FakeDraKubeApi, FakeKubeApi, RecordedRequest
from tests.fakes.kubeapi.groups import RESOURCES as GROUP_RESOURCES
from tests.fakes.kubeapi.jobs import JOB_RESOURCES, MPIJOB_V1, FakeJobsKubeApi
from tests.helpers.kube import k8s_node, k8s_pod
from tests.helpers.paths import SHARED, short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import http_ok, stop_process, wait_serving
from tests.helpers.scheduler import bind_body, cache_args, recorded

CALLS_FILE = DEPLOY / "rbac-calls.yaml"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
NODE = "dgx1-node"
RESOURCE = "nvidia.com/gpu"
PREFIX = "gpu-topology.io"
WAIT = 30.0  # liveness bound of every wait on a loaded 2-core machine, never a performance figure


class Call(NamedTuple):
    """What RBAC authorizes: verb on group/resource[/subresource]."""

    verb: str
    group: str
    resource: str
    subresource: str = ""

    def __str__(self) -> str:
        group = f"{self.group}/" if self.group else ""
        return f"{self.verb} {group}{self.resource}" + (f"/{self.subresource}" if self.subresource else "")


class NonResourceRequest(ValueError):
    """A request outside /api and /apis (RBAC's nonResourceURLs); the table has no such calls."""


def declared(component: str) -> set[Call]:
    table = yaml.safe_load(CALLS_FILE.read_text())
    return {Call(c["verb"], c.get("group", ""), c["resource"], c.get("subresource", "")) for c in table[component]}


_WATCH_VALUES = {"1", "true", "True"}


def rbac_call(request: RecordedRequest) -> Call:
    """The authorization attributes the apiserver derives from a request (its RequestInfoFactory):
    /api/v1/... is the core group, /apis/<group>/<version>/... a named one; namespaces/<ns>/ scopes what follows;
    GET on a collection is list (watch with watch=1), on a named object get; the legacy /watch/ prefix is watch;
    POST create, PUT update, PATCH patch, DELETE delete (deletecollection on a collection)."""
    parts = [p for p in request.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        raise NonResourceRequest(f"{request.method} {request.path}")
    legacy_watch = rest[:1] == ["watch"]
    if legacy_watch:
        rest = rest[1:]
    if len(rest) >= 3 and rest[0] == "namespaces":  # namespaces/<ns>/<resource>...; "namespaces/<ns>" alone is a
        rest = rest[2:]  # namespace object
    if not rest:
        raise NonResourceRequest(f"{request.method} {request.path}")
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else "", "/".join(rest[2:])
    watching = legacy_watch or request.query.get("watch") in _WATCH_VALUES
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    if request.method == "GET":
        verb = "watch" if watching else ("get" if name else "list")
    elif request.method == "DELETE":
        verb = "delete" if name else "deletecollection"
    elif request.method in verbs:
        verb = verbs[request.method]
    else:
        raise ValueError(f"no RBAC verb for {request.method} {request.path}")
    return Call(verb, group, resource, sub)


def observed(requests: list[RecordedRequest]) -> set[Call]:
    return {rbac_call(r) for r in requests}


def assert_equals_table(component: str, requests: list[RecordedRequest]) -> None:
    seen, table = observed(requests), declared(component)
    shown = ", ".join(sorted(map(str, seen)))
    assert seen - table == set(), f"{component} calls what rbac-calls.yaml does not declare; observed: {shown}"
    assert table - seen == set(), f"rbac-calls.yaml declares calls {component} never made; observed: {shown}"


def _is_list(resource: str) -> Callable[[RecordedRequest], bool]:
    return lambda r: r.method == "GET" and rbac_call(r) == Call("list", "", resource)


def _relist(fake: FakeKubeApi, resources: tuple[str, ...]) -> None:
    """A change no watcher is shown (a finished pod on another node), then the history compacted and every watch
    cut: each watcher reconnects from a resourceVersion older than the compaction, gets 410 and lists again."""
    lists = {r: sum(1 for q in list(fake.requests) if _is_list(r)(q)) for r in resources}
    fake.add_pod(k8s_pod(f"finished-{len(fake.requests)}", 0, "elsewhere", phase="Failed"))
    fake.expire_history()
    fake.drop_watches()
    for resource, n in lists.items():
        assert fake.wait_for_requests(_is_list(resource), n + 1, timeout=WAIT), f"no re-list of {resource}"
        assert fake.wait_for_watches(1, timeout=WAIT, resource=resource), f"no new watch on {resource}"


# ---------------------------------------------------------------------------------------------------------------
# the mapping itself


@pytest.mark.parametrize(("method", "path", "query", "call"), [
    ("GET", "/api/v1/nodes", {"limit": "500"}, Call("list", "", "nodes")),
    ("GET", "/api/v1/pods", {"watch": "1", "fieldSelector": "spec.nodeName=n"}, Call("watch", "", "pods")),
    ("GET", "/api/v1/watch/namespaces/ns/pods", {}, Call("watch", "", "pods")),
    ("GET", "/api/v1/namespaces/ns/pods/p", {}, Call("get", "", "pods")),
    ("PATCH", "/api/v1/nodes/n", {}, Call("patch", "", "nodes")),
    ("PATCH", "/api/v1/nodes/n/status", {}, Call("patch", "", "nodes", "status")),
    ("POST", "/api/v1/namespaces/ns/pods/p/binding", {}, Call("create", "", "pods", "binding")),
    ("POST", "/api/v1/namespaces/ns/bindings", {}, Call("create", "", "bindings")),
    ("DELETE", "/api/v1/namespaces/ns/pods", {}, Call("deletecollection", "", "pods")),
    ("GET", "/api/v1/namespaces/ns", {}, Call("get", "", "namespaces")),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", {}, Call("update", "coordination.k8s.io",
                                                                           "leases")),
])
def test_requests_map_to_what_rbac_checks(method: str, path: str, query: dict[str, str], call: Call) -> None:
    assert rbac_call(RecordedRequest(method, path, query)) == call


def test_comparison_notices_an_undeclared_call_and_an_unused_one() -> None:
    plugin = [RecordedRequest("GET", "/api/v1/nodes/n", {}), RecordedRequest("PATCH", "/api/v1/nodes/n", {}),
              RecordedRequest("GET", "/api/v1/pods", {}), RecordedRequest("GET", "/api/v1/pods", {"watch": "1"}),
              RecordedRequest("PATCH", "/api/v1/nodes/n/status", {}),
              RecordedRequest("POST", "/api/v1/namespaces/default/events", {})]
    assert_equals_table("plugin", plugin)
    with pytest.raises(AssertionError, match="does not declare"):
        assert_equals_table("plugin", [*plugin, RecordedRequest("PUT", "/api/v1/nodes/n", {})])
    with pytest.raises(AssertionError, match="never made"):
        assert_equals_table("plugin", plugin[1:])
    with pytest.raises(NonResourceRequest):
        rbac_call(RecordedRequest("GET", "/version", {}))


# ---------------------------------------------------------------------------------------------------------------
# the device plugin: publication, state change, plan watch, re-list


@pytest.fixture
def plugin_node(tmp_path: Path) -> Iterator[GpuNode]:
    """`gpuplugin run` as on a GPU node (tests/fakes/gpunode.py), reading PodResources often (its state change),
    with a directory of sharing configs (the node label may name one it does not have: a refusal)."""
    (tmp_path / "default").write_text("version: v1\n")
    with gpu_node(NODE, DGX1, args=["--device-id-strategy", "index", "--pod-resources-poll-interval", "0.2",
                                    "--sharing-config-dir", str(tmp_path), "--sharing-poll-interval", "0.2"]) as node:
        yield node


def test_plugin_calls_exactly_its_declared_api(plugin_node: GpuNode) -> None:
    fake, podres, kubelet = plugin_node.fake, plugin_node.podres, plugin_node.kubelet
    ids = [d.id for d in kubelet.wait_for_devices(RESOURCE, 8, timeout=WAIT)]

    def annotations() -> dict[str, str]:
        return (fake.node(NODE) or {}).get("metadata", {}).get("annotations", {})

    try:
        assert eventually(lambda: f"{PREFIX}/topology" in annotations(), WAIT), "no topology annotation"
        # A state change: the kubelet now holds GPUs 1 and 2 for a pod; the next poll publishes it.
        podres.service.set_pod("default", "holder", {"main": {RESOURCE: ["1", "2"]}})
        # The plan watch: a pod bound here with the extender's plan reaches GetPreferredAllocation.
        assert fake.wait_for_watches(1, timeout=WAIT, resource="pods")
        plan = {"v": 1, "node": NODE, "resource": RESOURCE, "containers": {"main": ["4", "7"]}, "gbps": 40.0}
        fake.add_pod(k8s_pod("trainer", 2, NODE, {f"{PREFIX}/plan": json.dumps(plan)}))
        podres.service.set_pod("default", "trainer", {"main": {}})  # listed by the kubelet as it admits it
        assert eventually(lambda: kubelet.preferred_raw(RESOURCE, ids, [], 2) == ["4", "7"], WAIT), (
            "the plan never reached the kubelet")
        _relist(fake, ("pods",))
        assert eventually(lambda: state_from_json(annotations().get(f"{PREFIX}/state", '{"v":1}')).used == {"1", "2"},
                          WAIT), "the new state never reached the Node"
        # A refused sharing config: the node label names a config the directory lacks (a condition and an Event).
        fake.update_node(NODE, {"metadata": {"labels": {"nvidia.com/device-plugin.config": "missing"}}})
        assert fake.wait_for_requests(lambda r: r.method == "POST" and r.path.endswith("/events"), timeout=WAIT), (
            "no Event about the refused config")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{plugin_node.log_tail()}") from None
    plugin_node.stop()
    assert_equals_table("plugin", list(fake.requests))


# ---------------------------------------------------------------------------------------------------------------
# the extender: cache sync, the four verbs, bind with 409, bind of an unknown pod, re-list




class _FakeJobsDraKubeApi(FakeJobsKubeApi, FakeDraKubeApi):
    """The group and job owner kinds, and resource.k8s.io/v1 (the extender's DRA node view)."""


@pytest.fixture
def extender_cluster() -> Iterator[dict[str, Any]]:
    """`gpu-extender serve --api-server <fake>` on a free loopback port, with one DGX-1 node published."""
    with short_dir("rbac-ext-") as root, _FakeJobsDraKubeApi() as fake:  # group, job owner and DRA kinds
        fake.add_node(k8s_node("n1", topo(DGX1)))
        port = free_port()
        with open(root / "extender.log", "wb") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "gpu-extender"), "serve", "--api-server", fake.url,
                 "--host", "127.0.0.1", "--port", str(port), "--reservation-timeout", "1"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            wait_serving(process, lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), WAIT, root / "extender.log")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                yield {"fake": fake, "client": client, "process": process, "log": root / "extender.log"}
        finally:
            stop_process(process)


def test_extender_calls_exactly_its_declared_api(extender_cluster: dict[str, Any]) -> None:
    fake, client = extender_cluster["fake"], extender_cluster["client"]
    try:
        p1, p2, p3 = (fake.add_pod(k8s_pod(name, 4)) for name in ("p1", "p2", "p3"))
        assert eventually(lambda: client.post("/filter", json=cache_args(p1, ["n1"])).json()["NodeNames"] == ["n1"],
                          WAIT), "p1 never fit n1"
        scores = client.post("/prioritize", json=cache_args(p1, ["n1"])).json()
        assert scores == [{"Host": "n1", "Score": scores[0]["Score"]}]
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        assert fake.pod("default", "p1")["spec"]["nodeName"] == "n1"

        # 409 on the Binding: the extender reads the pod back to tell a lost race from its own earlier success.
        fake.fail_next(1, 409, path_regex=r"/pods/p2/binding$", method="POST")
        assert "conflict" in client.post("/bind", json=bind_body(p2, "n1")).json()["Error"]
        # A pod deleted between filter and bind: not in the cache, so the extender asks the apiserver.
        ghost = dict(p3, metadata={**p3["metadata"], "name": "ghost", "uid": "uid-of-a-deleted-pod"})
        assert "not found" in client.post("/bind", json=bind_body(ghost, "n1")).json()["Error"]

        # A job's slot for its pod that never comes times out; a pod refused meanwhile is touched (PATCH) so that
        # kube-scheduler retries it.
        job = {"gpu-topology.io/job": "j", "gpu-topology.io/job-size": "2"}
        j0 = fake.add_pod(k8s_pod("j-0", 2, annotations=job))
        waiting = fake.add_pod(k8s_pod("waiting", 4))
        assert eventually(lambda: client.post("/filter", json=cache_args(j0, ["n1"])).json()["NodeNames"] == ["n1"],
                          WAIT), "the job never fit n1"
        assert client.post("/bind", json=bind_body(j0, "n1")).json() == {"Error": ""}
        assert client.post("/filter", json=cache_args(waiting, ["n1"])).json()["NodeNames"] == []
        assert eventually(lambda: "gpu-topology.io/requeued" in (fake.pod("default", "waiting") or {})
                          ["metadata"].get("annotations", {}), WAIT), "the refused pod was never touched"

        body = recorded("preempt-nodecache.json")
        body["Pod"] = p3
        body["NodeNameToMetaVictims"] = {"n1": {"NumPDBViolations": 0, "Pods": [{"UID": p1["metadata"]["uid"]}]}}
        assert client.post("/preempt", json=body).status_code == 200

        _relist(fake, ("nodes", "pods"))
        assert client.get("/readyz").status_code == 200
        for group, version, plural in GROUP_RESOURCES:  # job sizes: list, then watch, each group kind
            assert fake.wait_for_watches(1, timeout=WAIT, resource=f"{plural}.{version}.{group}"), plural
        for group, version, plural in set(JOB_RESOURCES) - {MPIJOB_V1}:  # and each owner kind installed
            assert fake.wait_for_watches(1, timeout=WAIT, resource=f"{plural}.{version}.{group}"), plural
        for plural in ("resourceslices", "resourceclaims"):  # DRA nodes: our driver's slices and the claims
            assert fake.wait_for_watches(1, timeout=WAIT, resource=plural), plural
    except AssertionError as e:
        raise AssertionError(f"{e}\n{extender_cluster['log'].read_text()[-4000:]}") from None
    stop_process(extender_cluster["process"])
    assert_equals_table("extender", list(fake.requests))


# ---------------------------------------------------------------------------------------------------------------
# the standalone extender's leader election (gpu-extender serve --leader-elect)


def test_leader_election_calls_are_exactly_the_declared_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica of `gpu-extender serve --leader-elect` on the fake API server with Leases: it creates the Lease,
    labels its own pod, renews, then stops and releases. Its requests beyond the extender's own (Leases, and PATCH
    of its pod) are exactly the table's extender-leader-election entry."""
    from extender.config import ExtenderConfig
    from extender.service import Extender
    from gputopo.kube import make_api_client
    from tests.fakes.kubeapi import FakeLeasesKubeApi

    namespace, pod = "gpu-topology", "gpu-topology-extender-0"
    with FakeLeasesKubeApi() as fake:
        fake.add_pod({"metadata": {"name": pod, "namespace": namespace},
                      "spec": {"containers": [{"name": "extender", "image": "registry.invalid/x:0"}]}})
        monkeypatch.setenv("POD_NAME", pod)
        api = make_api_client(host=fake.url, timeout_s=5.0)
        ext = Extender.cluster(api, ExtenderConfig(
            leader_elect=True, leader_elect_namespace=namespace, leader_elect_lease_duration_s=3,
            leader_elect_renew_deadline_s=2, leader_elect_retry_period_s=1),
            sync_options={"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.1})
        try:
            ext.start()
            assert eventually(ext.leading, WAIT)
            def lease_rv() -> str:
                return (fake.lease(namespace, "gpu-extender") or {}).get("metadata", {}).get("resourceVersion", "")

            acquired = lease_rv()
            assert eventually(lambda: lease_rv() != acquired and ext.leading(), WAIT)  # a renewal
        finally:
            ext.stop()
            api.close()
        assert fake.holder(namespace, "gpu-extender") is None  # released
        requests = [r for r in fake.requests if "/leases" in r.path or (r.method == "PATCH" and "/pods/" in r.path)]
    assert_equals_table("extender-leader-election", requests)
    with pytest.raises(AssertionError, match="never made"):
        assert_equals_table("extender-leader-election", [r for r in requests if r.method != "POST"])
