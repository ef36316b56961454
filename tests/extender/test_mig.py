"""MIG instances (issue 23, the extender's half) through real HTTP with kube-scheduler's recorded bodies: filter by
free instances of the asked profile, partly used GPUs first, several instances on the fewest GPUs of one NUMA node,
plans naming MIG UUIDs, reservations so one instance is never planned twice, clear refusals (unknown profile, MIG
and whole GPUs in one pod, strategy none), in standalone (inventory) and cluster mode (the fake apiserver, nodes
publishing the contract's state annotation); and the choice against exhaustive search over small fleets."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.placement.mig import MigChoiceOnNode, mig_choice, mig_scores
from extender.state.cache import make_entry
from extender.state.mig import node_mig
from gputopo.contract import mig_resource, parse_plan
from gputopo.core import NodeState, state_to_json
from gputopo.core.codec import Mig, MigGpuInfo, MigInstance, mig_to_dict
from tests.extender.conftest import DGX1
from tests.extender.test_cluster import cluster, filter_names
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.clients import thread_clients
from tests.helpers.kube import GPU, PREFIX, k8s_node, k8s_pod
from tests.helpers.scheduler import bind_body, cache_args, pod_json

ONE = mig_resource("1g.18gb")
THREE = mig_resource("3g.71gb")
PLAN, PLACEMENT = f"{PREFIX}/plan", f"{PREFIX}/placement"
H200 = "NVIDIA H200"


def mig_pod(n: int, resource: str = ONE, *, whole: int = 0, name: str = "notebook") -> dict[str, Any]:
    """The recorded Pod asking for `n` of `resource` (and `whole` nvidia.com/gpu beside it)."""
    pod = pod_json(name, 0)
    limits = {resource: str(n), **({GPU: str(whole)} if whole else {})}
    pod["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": dict(limits)}
    return pod


def sevens(node: str, gpu: int, used: int = 0, numa: int | None = 0, strategy: str = "mixed",
           resource: str | None = ONE) -> MigGpuInfo:
    """A GPU cut in seven 1g.18gb instances, the first `used` held."""
    return MigGpuInfo(f"GPU-{node}-{gpu}", gpu, numa, None, H200, tuple(
        MigInstance("1g.18gb", s, 1, f"MIG-{node}-{gpu}-{s}", resource, s < used) for s in range(7)))


def halves(node: str, gpu: int, used: int = 0, numa: int | None = 0) -> MigGpuInfo:
    """A GPU cut in two 3g.71gb instances."""
    return MigGpuInfo(f"GPU-{node}-{gpu}", gpu, numa, None, H200, tuple(
        MigInstance("3g.71gb", s, 4, f"MIG-{node}-{gpu}-{s}", THREE, k < used) for k, s in enumerate((0, 4))))


def block(*gpus: MigGpuInfo, strategy: str = "mixed", reason: str | None = None) -> dict[str, Any]:
    """The inventory's `mig` block (the state's member without its version)."""
    body = mig_to_dict(Mig(strategy, reason, gpus))
    body.pop("v")
    return body


def plans(client: httpx.Client) -> dict[str, dict[str, Any]]:
    return {p["name"]: p["plan"] for p in client.get("/inventory").json()["pods"]}


def best(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> str:
    out = client.post("/filter", json=cache_args(pod, names)).json()
    scores = {s["Host"]: s["Score"] for s in client.post("/prioritize", json=cache_args(pod, out["NodeNames"])).json()}
    return max(sorted(scores), key=scores.__getitem__)


# -- standalone (inventory) ------------------------------------------------------------------------------------------


def test_an_instance_goes_to_the_partly_used_gpu_and_idle_gpus_stay_whole(standalone) -> None:
    nodes = [
        {"name": "idle", "mig": block(sevens("idle", 0), sevens("idle", 1))},
        {"name": "busy", "mig": block(sevens("busy", 0), sevens("busy", 1, used=3))},
    ]
    names = ["idle", "busy"]
    with standalone(nodes) as (_, client):
        landed = []
        for i in range(5):
            pod = mig_pod(1, name=f"nb-{i}")
            node = best(client, pod, names)
            assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}
            landed.append((node, plans(client)[f"nb-{i}"]["containers"]["main"]))
    # GPU 1 of busy (3 of 7 held) fills first, lowest free slice first; the idle node and GPU 0 of busy stay whole
    assert landed == [("busy", [f"MIG-busy-1-{s}"]) for s in (3, 4, 5, 6)] + [("busy", ["MIG-busy-0-0"])]


def test_several_instances_go_on_the_fewest_gpus_of_one_numa_node(standalone) -> None:
    # 4 free on GPU 0 (numa 0) + 3 on GPU 1 (numa 1) vs 3 + 3 on GPUs 2, 3 of numa 0 ... and one GPU with 6 free
    spread = [sevens("a", 0, used=3, numa=0), sevens("a", 1, used=4, numa=1)]
    local = [sevens("b", 0, used=4, numa=0), sevens("b", 1, used=4, numa=0)]
    one = [sevens("c", 0, used=1, numa=0), sevens("c", 1, used=0, numa=1)]
    nodes = [{"name": "a", "mig": block(*spread)}, {"name": "b", "mig": block(*local)},
             {"name": "c", "mig": block(*one)}]
    pod = mig_pod(6)
    with standalone(nodes) as (_, client):
        scores = {s["Host"]: s["Score"] for s in client.post("/prioritize", json=cache_args(pod, ["a", "b", "c"])
                                                             ).json()}
        assert scores["c"] > scores["b"] > scores["a"]  # one GPU; then two GPUs of one NUMA node; then two nodes
        assert client.post("/bind", json=bind_body(pod, "c")).json() == {"Error": ""}
        ids = plans(client)["notebook"]["containers"]["main"]
    assert sorted(ids) == [f"MIG-c-0-{s}" for s in range(1, 7)]


def test_refusals_name_the_profile_and_the_reason(standalone) -> None:
    nodes = [
        {"name": "full", "mig": block(sevens("full", 0, used=7))},
        {"name": "halves", "mig": block(halves("halves", 0))},
        {"name": "off", "mig": block(sevens("off", 0, resource=None), strategy="none",
                                     reason="MIG devices are not advertised by this plugin (MIG strategy none)")},
        {"name": "cordoned", "mig": block(sevens("cordoned", 0)), "unschedulable": True},
    ]
    names = [n["name"] for n in nodes]
    with standalone(nodes) as (_, client):
        out = client.post("/filter", json=cache_args(mig_pod(1), names)).json()
        unknown = client.post("/filter", json=cache_args(mig_pod(1, "nvidia.com/mig-5g.50gb"), names)).json()
        both = client.post("/filter", json=cache_args(mig_pod(1, whole=1), names)).json()
    assert out["NodeNames"] == []
    assert out["FailedNodes"] == {"full": "needs 1 1g.18gb instance, 0 free: 7 in use"}
    unres = out["FailedAndUnresolvableNodes"]
    assert unres["halves"] == f"has no {ONE} instances (MIG strategy mixed; advertises 3g.71gb)"
    assert unres["off"] == "MIG devices are not advertised by this plugin (MIG strategy none)"
    assert unres["cordoned"] == "node is cordoned (spec.unschedulable)"
    assert unknown["NodeNames"] == []
    assert all("'nvidia.com/mig-5g.50gb' names no MIG profile" in r and "1g.18gb" in r
               for r in unknown["FailedAndUnresolvableNodes"].values())
    assert both["NodeNames"] == [] and both["Error"] == (
        f"pod cannot be placed: asks for {ONE} (MIG instances) and {GPU} (whole GPUs): a pod takes MIG instances or "
        "whole GPUs, not both")


def test_single_strategy_serves_whole_gpu_requests_with_instances_and_whole_nodes_keep_theirs(standalone) -> None:
    single = [sevens("s", g, resource=GPU, used=2 if g == 1 else 0) for g in range(2)]
    nodes = [{"name": "single", "mig": block(*single, strategy="single")},
             {"name": "dgx", "topology": str(DGX1)}]
    pod = pod_json("p", 2)
    with standalone(nodes) as (_, client):
        out = client.post("/filter", json=cache_args(pod, ["single", "dgx"])).json()
        assert sorted(out["NodeNames"]) == ["dgx", "single"]
        assert client.post("/bind", json=bind_body(pod, "single")).json() == {"Error": ""}
        plan = plans(client)["p"]
    assert plan["resource"] == GPU and plan["containers"]["main"] == ["MIG-s-1-2", "MIG-s-1-3"]


def test_a_finished_pod_gives_its_instances_back(standalone) -> None:
    nodes = [{"name": "n", "mig": block(halves("n", 0))}]
    with standalone(nodes) as (_, client):
        pods = [mig_pod(1, THREE, name=f"p{i}") for i in range(3)]
        for p in pods[:2]:
            client.post("/filter", json=cache_args(p, ["n"]))
            assert client.post("/bind", json=bind_body(p, "n")).json() == {"Error": ""}
        client.post("/filter", json=cache_args(pods[2], ["n"]))
        assert "cannot take pod" in client.post("/bind", json=bind_body(pods[2], "n")).json()["Error"]
        uid = pods[0]["metadata"]["uid"]
        assert client.delete(f"/inventory/pods/{uid}").status_code == 200
        assert client.post("/bind", json=bind_body(pods[2], "n")).json() == {"Error": ""}
        assert plans(client)["p2"]["containers"]["main"] == ["MIG-n-0-0"]  # p0's, given back


# -- cluster mode: the plugin's state annotation, reservations ---------------------------------------------------------


def mig_state(mig: Mig, generation: int = 1) -> str:
    return state_to_json(NodeState(generation, frozenset(), frozenset(), None, mig))


def mig_node(name: str, mig: Mig, generation: int = 1) -> dict[str, Any]:
    """A MIG-only node: no topology annotation, the state with its "mig" member."""
    node = k8s_node(name, annotations={f"{PREFIX}/state": mig_state(mig, generation)})
    node["status"]["allocatable"] = {ONE: "7"}
    return node


def k8s_mig_pod(name: str, n: int, resource: str = ONE) -> dict[str, Any]:
    pod = k8s_pod(name, 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {resource: str(n)}, "requests": {resource: str(n)}}
    return pod


def test_cluster_bind_writes_mig_uuids_explains_and_reserves_until_published(fake: FakeKubeApi, api) -> None:
    mig = Mig("mixed", None, (sevens("n1", 0), sevens("n1", 2, used=2)))
    fake.add_node(mig_node("n1", mig))
    p1, p2 = fake.add_pod(k8s_mig_pod("p1", 1)), fake.add_pod(k8s_mig_pod("p2", 1))
    with cluster(api) as (ext, client):
        assert filter_names(client, p1, ["n1"])["NodeNames"] == ["n1"]
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        ann = fake.pod("default", "p1")["metadata"]["annotations"]
        plan = parse_plan(ann[PLAN])
        assert plan.resource == ONE and plan.ids == {"MIG-n1-2-2"}
        assert ann[PLACEMENT] == "n1: mig-1g.18gb on GPU 2, 3 of 7 in use"
        assert client.post("/bind", json=bind_body(p2, "n1")).json() == {"Error": ""}
        assert parse_plan(fake.pod("default", "p2")["metadata"]["annotations"][PLAN]).ids == {"MIG-n1-2-3"}
        # the plugin publishes p1 held: its reservation settles, p2's stays
        held = Mig("mixed", None, (sevens("n1", 0), MigGpuInfo("GPU-n1-2", 2, 0, None, H200, tuple(
            MigInstance("1g.18gb", s, 1, f"MIG-n1-2-{s}", ONE, s < 3) for s in range(7)))))
        fake.update_node("n1", {"metadata": {"annotations": {f"{PREFIX}/state": mig_state(held, 2)}}})
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 1, 10)
        assert ext.reservations.all()[0].name == "p2"


def test_concurrent_binds_never_plan_an_instance_twice_and_survive_a_restart(fake: FakeKubeApi, api) -> None:
    names = [f"n{i}" for i in range(3)]
    for name in names:  # 3 nodes x 2 GPUs x 7 instances = 42, 6 of them held
        fake.add_node(mig_node(name, Mig("mixed", None, (sevens(name, 0, used=2), sevens(name, 1, used=0)))))
    sizes = [1, 2, 1, 3]
    pods = [fake.add_pod(k8s_mig_pod(f"p{i}", sizes[i % 4])) for i in range(30)]

    def bind_all(client: httpx.Client, batch: list[dict[str, Any]], offset: int) -> list[str]:
        with thread_clients(client.base_url) as mine, ThreadPoolExecutor(12) as pool:
            return list(pool.map(lambda k: mine().post("/bind", json=bind_body(
                batch[k], names[(k + offset) % 3])).json()["Error"], range(len(batch))))

    with cluster(api) as (_, client):
        first = bind_all(client, pods[:12], 0)
    with cluster(api) as (ext, client):  # restart with every plan in flight: nothing is published held
        assert ext.reservations.count() == first.count("")
        second = bind_all(client, pods[12:], 1)
    errors = first + second
    assert all("cannot take pod" in e for e in errors if e), [e for e in errors if e][:3]
    taken: list[str] = []
    for p in fake.pods():
        text = (p["metadata"].get("annotations") or {}).get(PLAN)
        if text:
            plan = parse_plan(text)
            assert all(i.startswith(f"MIG-{plan.node}-") for i in plan.ids)
            taken.extend(plan.ids)
    assert len(taken) == len(set(taken)) == 36  # every free instance, none twice
    assert not any(i.endswith(("-0-0", "-0-1")) for i in taken)  # held ones never planned


def test_hostile_mig_states_make_the_node_unusable_with_the_field_named(fake: FakeKubeApi, api) -> None:
    good = mig_to_dict(Mig("mixed", None, (sevens("x", 0),)))
    overlap = {**good, "gpus": [{**good["gpus"][0], "instances": [["1g.18gb", 0, 1, "a", ONE, 0],
                                                                  ["2g.35gb", 0, 2, "b", None, 0]]}]}
    for name, member in (("overlap", overlap), ("deep", {"v": 1, "gpus": [[[[[]]]]]}), ("huge", {
            **good, "gpus": [{**good["gpus"][0], "index": i, "gpu": f"g{i}"} for i in range(65)]})):
        state = '{"v":1,"gen":1,"used":[],"unhealthy":[],"mig":' + __import__("json").dumps(member) + "}"
        fake.add_node(k8s_node(name, annotations={f"{PREFIX}/state": state}))
    fake.add_node(mig_node("fine", Mig("mixed", None, (sevens("fine", 0),))))
    with cluster(api) as (_, client):
        out = filter_names(client, fake.add_pod(k8s_mig_pod("p", 1)), ["overlap", "deep", "huge", "fine"])
    assert out["NodeNames"] == ["fine"]
    unres = out["FailedAndUnresolvableNodes"]
    assert set(unres) == {"overlap", "deep", "huge"}
    assert "instances[1] (2g.35gb at {0}:2) overlaps another instance" in unres["overlap"]
    assert "state mig 'strategy' must be one of none, single, mixed" in unres["deep"]
    assert "state mig 'gpus' must list at most 64" in unres["huge"]


# -- the choice against exhaustive search -----------------------------------------------------------------------------

_LAYOUTS = {  # (device name, start, size) of one GPU's partition
    "sevens": [("1g.18gb", s, 1) for s in range(7)],
    "mixed": [("3g.71gb", 0, 4), ("2g.35gb", 4, 2), ("1g.18gb", 6, 1)],
    "ones-and-three": [("1g.18gb", s, 1) for s in range(4)] + [("3g.71gb", 4, 4)],
}


@st.composite
def fleets(draw: st.DrawFn) -> list[Mig]:
    nodes = []
    for n in range(draw(st.integers(1, 3))):
        gpus = []
        for g in range(draw(st.integers(1, 3))):
            layout = _LAYOUTS[draw(st.sampled_from(sorted(_LAYOUTS)))]
            held = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
            gpus.append(MigGpuInfo(f"G{n}{g}", g, draw(st.sampled_from([0, 1])), None, H200, tuple(
                MigInstance(p, s, z, f"M{n}{g}{s}", mig_resource(p), h) for (p, s, z), h in zip(layout, held,
                                                                                                 strict=True))))
        nodes.append(Mig("mixed", None, tuple(gpus)))
    return nodes


def _exhaustive(mig: Mig, profile: str, size: int) -> tuple[int, ...] | None:
    """The best rank over every set of `size` free instances: (GPUs, NUMA nodes, untouched GPUs, 0, -held slices of
    the GPUs)."""
    free = [(g, i) for g in mig.gpus for i in g.instances if i.profile == profile and not i.used]
    best = None
    for combo in itertools.combinations(free, size):
        gpus = {g.gpu: g for g, _ in combo}.values()
        rank = (len(gpus), len({g.numa for g in gpus}), sum(1 for g in gpus if not any(i.used for i in g.instances)),
                0, -sum(i.size for g in gpus for i in g.instances if i.used))
        best = rank if best is None or rank < best else best
    return best


@settings(max_examples=150, deadline=None)
@given(fleets(), st.sampled_from(["1g.18gb", "3g.71gb", "2g.35gb"]), st.integers(1, 4))
def test_the_node_choice_and_the_ranking_match_exhaustive_search(fleet: list[Mig], profile: str, size: int) -> None:
    resource = mig_resource(profile)
    choices = []
    for k, mig in enumerate(fleet):
        entry = make_entry(f"n{k}", None, mig=node_mig(mig))
        got = mig_choice(entry, resource, size, frozenset())
        want = _exhaustive(mig, profile, size)
        if want is None:
            assert not isinstance(got, MigChoiceOnNode)
            choices.append(None)
            continue
        assert isinstance(got, MigChoiceOnNode)
        assert got.rank[:5] == want
        assert len(set(got.uuids)) == size
        free = {i.uuid for g in mig.gpus for i in g.instances if i.profile == profile and not i.used}
        assert set(got.uuids) <= free
        choices.append(got)
    scores = mig_scores(choices)
    ranked = [(c.rank, s) for c, s in zip(choices, scores, strict=True) if c is not None]
    for (ra, sa), (rb, sb) in itertools.permutations(ranked, 2):
        if ra < rb:
            assert sa >= sb  # a better rank never scores lower
    assert all(s == 0 for c, s in zip(choices, scores, strict=True) if c is None)


def test_inventory_mig_errors_name_the_node_and_the_field(tmp_path) -> None:
    from extender.state.inventory import InventoryError, parse_inventory

    good = block(sevens("n", 0))
    bad_instance = {**good, "gpus": [{**good["gpus"][0], "instances": [["1g.18gb", 9, 1, "u", ONE, 0]]}]}
    for spec, message in (
        ({"name": "n", "mig": "all"}, "node n mig must be a mapping"),
        ({"name": "n", "mig": {**good, "strategy": "dynamic"}}, "node n mig: state mig 'strategy' must be one of"),
        ({"name": "n", "mig": bad_instance}, r"node n mig: .*instances\[0\] start must be an integer from 0 to 7"),
        ({"name": "n", "mig": good, "used": ["GPU0"]}, "node n has no topology .MIG only.: used need one"),
    ):
        try:
            parse_inventory({"nodes": [spec]}, tmp_path)
        except InventoryError as e:
            assert __import__("re").search(message, str(e)), str(e)
        else:
            raise AssertionError(f"accepted {spec}")


def test_a_pod_asking_two_mig_profiles_is_refused_and_so_is_nvlink_between_instances(standalone) -> None:
    pod = mig_pod(1)
    pod["spec"]["containers"][0]["resources"]["limits"][THREE] = "1"
    nvlink = mig_pod(2, name="ring")
    nvlink["metadata"].setdefault("annotations", {})[f"{PREFIX}/require-nvlink"] = "true"
    with standalone([{"name": "n", "mig": block(sevens("n", 0))}]) as (_, client):
        two = client.post("/filter", json=cache_args(pod, ["n"])).json()
        ring = client.post("/filter", json=cache_args(nvlink, ["n"])).json()
    assert two["NodeNames"] == [] and two["Error"] == (
        f"pod cannot be placed: asks for MIG instances of {ONE} and of {THREE}: a pod takes instances of one MIG "
        "profile")
    assert ring["FailedAndUnresolvableNodes"]["n"].endswith("MIG instances have no NVLink or P2P between them")


def test_an_island_with_a_whole_gpu_held_is_broken_first(standalone) -> None:
    def gpu(node: str) -> MigGpuInfo:
        g = sevens(node, 7)
        return MigGpuInfo(g.gpu, g.index, g.numa, 0, g.model, g.instances, ("GPU0", "GPU1"))

    nodes = [{"name": name, "topology": str(DGX1), "used": used, "mig": block(gpu(name))}
             for name, used in (("a", []), ("b", ["GPU0"]))]
    pod = mig_pod(1)
    with standalone(nodes) as (_, client):
        scores = {s["Host"]: s["Score"] for s in client.post("/prioritize", json=cache_args(pod, ["a", "b"])).json()}
    assert scores["b"] > scores["a"]  # a's island is whole: it stays for an NVLink job
