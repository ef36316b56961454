"""A pod's needs are read once, in one pass over its containers, and kept by UID (extender.state.pods.PodNeedsCache).

Why these tests: the one-pass reading replaced one pass per resource name (the configured one, every shared name,
the MIG names), so it must answer every pod exactly as that reading did, errors and their words included; the
oracle below is that reading, kept here as the reference. The cache must stay bounded, forget a deleted pod, and
still follow what may change after creation: the pod's annotations and the names the nodes share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.state.cache import NodeCache
from extender.state.pods import Need, PodNeeds, PodNeedsCache, PodSpecError, constraints, pod_needs
from extender.state.reservations import Reservations
from gputopo.contract import MIG_RESOURCE_PREFIX, Keys
from gputopo.podspec import ContainerNeed, container_needs, effective_count
from tests.helpers.scheduler import pod_json

RES = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
SMALL = "example.com/gpu.small"
MIG = "nvidia.com/mig-1g.10gb"
MIG2 = "nvidia.com/mig-2g.20gb"
KEYS = Keys()
NVLINK, GBPS = KEYS.require_nvlink, KEYS.min_gbps


# -- the reference: the reading before, one pass over the spec per resource name -----------------------------------

Ask = tuple[str, tuple[ContainerNeed, ...], int]


def _d(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _asks(pod: Mapping[str, Any], names: Iterable[str]) -> list[Ask]:
    out = []
    for name in names:
        containers = container_needs(pod, name)
        if count := effective_count(containers):
            out.append((name, containers, count))
    return out


def _shared_ask(pod: Mapping[str, Any], resource: str, size: int, shared: frozenset[str]) -> Ask | None:
    asks = _asks(pod, sorted(shared - {resource}))
    if not asks:
        return None
    if len(asks) > 1:
        raise PodSpecError(f"asks for replicas of {asks[0][0]} and of {asks[1][0]}: a pod takes replicas of one "
                           "shared resource")
    if size:
        raise PodSpecError(f"asks for {asks[0][0]} (replicas of shared GPUs) and {resource} (whole GPUs): a pod "
                           "takes shared replicas or whole GPUs, not both")
    return asks[0]


def _asked_names(pod: Mapping[str, Any], prefix: str) -> list[str]:
    names: set[str] = set()
    for field in ("initContainers", "containers"):
        items = _d(pod.get("spec")).get(field)
        for c in items if isinstance(items, list) else ():
            res = _d(_d(c).get("resources"))
            for part in ("limits", "requests"):
                names.update(k for k in _d(res.get(part)) if isinstance(k, str) and k.startswith(prefix))
    return sorted(names)


def _mig_ask(pod: Mapping[str, Any], resource: str, size: int, shared: str | None) -> Ask | None:
    asks = _asks(pod, _asked_names(pod, f"{resource.split('/', 1)[0]}/{MIG_RESOURCE_PREFIX}"))
    if not asks:
        return None
    if len(asks) > 1:
        raise PodSpecError(f"asks for MIG instances of {asks[0][0]} and of {asks[1][0]}: a pod takes instances of "
                           "one MIG profile")
    if size:
        raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {resource} (whole GPUs): a pod takes MIG "
                           "instances or whole GPUs, not both")
    if shared:
        raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {shared} (replicas of shared GPUs): a pod "
                           "takes one of them")
    return asks[0]


def reference_needs(pod: Any, resource: str, keys: Keys, shared: frozenset[str]) -> PodNeeds:
    if not isinstance(pod, dict):
        raise PodSpecError("Pod must be an object")
    meta = _d(pod.get("metadata"))
    containers = container_needs(pod, resource)
    size = effective_count(containers)
    ask = _shared_ask(pod, resource, size, shared) if shared else None
    asked: str | None = None
    if ask is not None:
        asked, containers, size = ask
    mig = _mig_ask(pod, resource, 0 if ask is not None else size, asked)
    if mig is not None:
        asked, containers, size = mig
    require_nvlink, min_gbps = constraints(_d(meta.get("annotations")), keys)
    need = Need(size=size, require_nvlink=require_nvlink, min_gbps=min_gbps, resource=asked,
                container_max=max((c.count for c in containers), default=0))
    return PodNeeds(str(meta.get("uid") or ""), str(meta.get("namespace") or "default"), str(meta.get("name") or ""),
                    need, tuple(c for c in containers if c.count > 0))


def outcome(read: Any, *args: Any) -> PodNeeds | str:
    try:
        return read(*args)
    except PodSpecError as e:
        return f"PodSpecError: {e}"


# -- pods of every shape, malformed ones included --------------------------------------------------------------------

good = ["0", "1", "1", "2", "2", "4", "2000m", 3]
quantities = st.sampled_from([*good, *good, *good, "1.5", "-1", "two", None, True])  # mostly readable
resources = st.dictionaries(st.sampled_from([RES, RES, SHARED, SHARED, SMALL, MIG, MIG2, "cpu", "memory"]), quantities,
                            max_size=3)
asks = st.fixed_dictionaries({}, optional={"limits": resources, "requests": resources})
FLAWS = ["none"] * 6 + ["repeated name", "no name", "not an object", "not a list", "no spec", "not a pod"]


@st.composite
def pods(draw: st.DrawFn) -> Any:
    """A pod of init (some sidecars) and app containers asking any of the names; now and then one flaw."""
    inits = [{"name": f"i{n}", "resources": draw(asks), **({"restartPolicy": "Always"} if draw(st.booleans()) else {})}
             for n in range(draw(st.integers(0, 2)))]
    apps = [{"name": f"c{n}", "resources": draw(asks)} for n in range(draw(st.integers(0, 3)))]
    notes = draw(st.fixed_dictionaries({}, optional={NVLINK: st.sampled_from(["true", "false", "true", "maybe"]),
                                                     GBPS: st.sampled_from(["0", "100", "100", "-3", "fast"])}))
    spec: dict[str, Any] = {"containers": apps, **({"initContainers": inits} if inits else {})}
    flaw = draw(st.sampled_from(FLAWS))
    if flaw == "repeated name" and apps:
        apps[-1]["name"] = (inits or apps)[0]["name"]
    elif flaw == "no name" and apps:
        del apps[-1]["name"]
    elif flaw == "not an object":
        apps.insert(draw(st.integers(0, len(apps))), "not an object")
    elif flaw == "not a list":
        spec["initContainers"] = "not a list"
    elif flaw == "no spec":
        return {"metadata": {"uid": "u"}}
    elif flaw == "not a pod":
        return "not a pod"
    return {"metadata": {"uid": "u", "name": "p", "annotations": notes}, "spec": spec}


shared_sets = st.sets(st.sampled_from([SHARED, SMALL, RES]), max_size=3).map(frozenset)


@settings(max_examples=600, deadline=None)
@given(pod=pods(), shared=shared_sets)
def test_one_pass_answers_every_pod_as_the_reading_per_resource_did(pod: Any, shared: frozenset[str]) -> None:
    expected = outcome(reference_needs, pod, RES, KEYS, shared)
    assert outcome(pod_needs, pod, RES, KEYS, shared) == expected
    cache = PodNeedsCache(RES, KEYS)
    assert outcome(cache.of, pod, shared) == expected
    assert outcome(cache.of, pod, shared) == expected  # the kept reading answers the same


def test_a_pod_is_read_once_and_its_needs_follow_the_shared_names_and_its_annotations() -> None:
    cache = PodNeedsCache(RES, KEYS)
    pod = pod_json("p", 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {SHARED: "2"}}
    assert cache.of(pod).need == Need(0, container_max=0)  # no node shares it yet: no GPU asked
    assert cache.of(pod, frozenset({SHARED})).need == Need(2, resource=SHARED, container_max=2)
    assert cache.asks(pod) is cache.asks(pod) and len(cache) == 1  # one reading, kept by UID
    pod["metadata"]["annotations"] = {GBPS: "100"}  # annotations may change after creation
    assert cache.of(pod, frozenset({SHARED})).need.min_gbps == 100.0


def test_the_cache_is_bounded_and_forgets_a_deleted_pod() -> None:
    cache = PodNeedsCache(RES, KEYS, limit=3)
    pods = [pod_json(f"p{i}", 1) for i in range(5)]
    for pod in pods:
        cache.of(pod)
    assert len(cache) == 3
    cache.forget(pods[-1]["metadata"]["uid"])
    assert len(cache) == 2

    nodes = NodeCache(ExtenderConfig(), Reservations(60.0))
    gpu_pod = pod_json("gpu", 2)
    assert nodes.update_pod(gpu_pod) is not None and len(nodes.needs) == 1
    nodes.remove_pod(gpu_pod["metadata"]["uid"])  # deleted
    assert len(nodes.needs) == 0
