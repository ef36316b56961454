"""The HTTP contract with kube-scheduler, over real HTTP, with the bodies a real kube-scheduler sent."""

from __future__ import annotations

import json

import pytest

from extender.http import models
from tests.extender.conftest import A100, PCIE, topo
from tests.helpers.kube import node_annotations
from tests.helpers.scheduler import bind_body, cache_args, list_args, node_item, pod_json, recorded

FILTER_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
NODES = [{"name": "a100", "topology": A100, "replicas": 2}, {"name": "pcie", "topology": PCIE},
         {"name": "busy", "topology": A100, "used": [0, 1, 2, 3, 4, 5]}]
NAMES = ["a100-0", "a100-1", "pcie", "busy"]


@pytest.mark.parametrize("name", ["filter.json", "filter-nodecache.json", "prioritize.json",
                                  "prioritize-nodecache.json", "bind.json", "preempt.json",
                                  "preempt-nodecache.json"])
def test_recorded_requests_match_the_published_models(name: str) -> None:
    body = recorded(name)
    model = {"filter": models.ExtenderArgs, "prioritize": models.ExtenderArgs, "bind": models.ExtenderBindingArgs,
             "preempt": models.ExtenderPreemptionArgs}[name.split("-")[0].split(".")[0]]
    model.model_validate(body)


@pytest.mark.parametrize("name", ["filter-response.json", "prioritize-response.json", "bind-response.json",
                                  "preempt-response.json"])
def test_recorded_answers_match_the_published_models(name: str) -> None:
    model = {"filter": models.ExtenderFilterResult, "prioritize": models.HostPriorityList,
             "bind": models.ExtenderBindingResult, "preempt": models.ExtenderPreemptionResult}[name.split("-")[0]]
    model.model_validate(recorded(name))


def test_filter_node_cache_mode_answers_names_only_from_the_input(standalone) -> None:
    with standalone(NODES) as (_, client):
        body = cache_args(pod_json(gpus=4), [*NAMES, "ghost"])
        raw = json.dumps(body)
        assert '"Nodes": null' in raw  # the explicit null kube-scheduler sends reaches the server as sent
        r = client.post("/filter", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == FILTER_KEYS and out["Nodes"] is None and out["Error"] == ""
    models.ExtenderFilterResult.model_validate(out)
    assert out["NodeNames"] == ["a100-0", "a100-1", "pcie"]
    assert out["FailedNodes"] == {"busy": "needs 4 GPUs, 2 free: GPU 0-5 in use"}
    assert "ghost" in out["FailedAndUnresolvableNodes"]
    assert set(out["NodeNames"]) | set(out["FailedNodes"]) | set(out["FailedAndUnresolvableNodes"]) == {
        *NAMES, "ghost"}


def test_filter_full_nodelist_mode_returns_the_kept_node_objects(standalone) -> None:
    t = topo(A100)
    # one node the extender knows, one it only sees in the body (its annotations are read from the body)
    items = [node_item("a100-0"), node_item("from-body", node_annotations(t, used=["GPU0"])),
             node_item("no-topology"), node_item("pcie")]
    with standalone(NODES) as (_, client):
        r = client.post("/filter", json=list_args(pod_json(gpus=8), items))
    out = r.json()
    assert r.status_code == 200 and set(out) == FILTER_KEYS
    assert out["NodeNames"] is None
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["a100-0", "pcie"]
    assert out["Nodes"]["items"][0] == items[0]  # objects come back as sent, every key kept
    assert out["FailedNodes"] == {"from-body": "needs 8 GPUs, 7 free: GPU 0 in use"}
    assert "publishes no GPU topology" in out["FailedAndUnresolvableNodes"]["no-topology"]
    models.ExtenderFilterResult.model_validate(out)


@pytest.mark.parametrize("mode", ["cache", "list"])
def test_prioritize_answers_integer_scores_for_every_input_node(standalone, mode: str) -> None:
    pod = pod_json(gpus=2)
    with standalone(NODES) as (_, client):
        body = cache_args(pod, NAMES) if mode == "cache" else list_args(pod, [node_item(n) for n in NAMES])
        r = client.post("/prioritize", json=body)
    assert r.status_code == 200
    raw = r.text
    out = r.json()
    assert isinstance(out, list) and [h["Host"] for h in out] == NAMES
    assert all(set(h) == {"Host", "Score"} and type(h["Score"]) is int and 0 <= h["Score"] <= 10 for h in out)
    assert ".0" not in raw.replace('"', "")  # no 7.0: Go decodes Score as int64
    models.HostPriorityList.model_validate(out)
    scores = {h["Host"]: h["Score"] for h in out}
    assert scores["a100-0"] == scores["a100-1"]  # equal states, equal scores (the ranking is tested elsewhere)


def test_bind_answers_the_recorded_shape(standalone) -> None:
    pod = pod_json(gpus=2)
    with standalone(NODES) as (_, client):
        assert client.post("/filter", json=cache_args(pod, NAMES)).status_code == 200
        r = client.post("/bind", json=bind_body(pod, "a100-0"))
    assert r.status_code == 200 and r.json() == recorded("bind-response.json") == {"Error": ""}


@pytest.mark.parametrize("name", ["preempt.json", "preempt-nodecache.json"])
def test_preempt_answers_meta_victims(standalone, name: str) -> None:
    body = recorded(name)
    with standalone([{"name": "gpu-node-5", "topology": A100}]) as (_, client):
        r = client.post("/preempt", json=body)
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"NodeNameToMetaVictims"}
    models.ExtenderPreemptionResult.model_validate(out)
    # the 8-GPU pod fits gpu-node-5 once its victims are gone (it is empty as far as the inventory goes)
    victims = body["NodeNameToMetaVictims"] or {
        n: {"Pods": [{"UID": p["metadata"]["uid"]} for p in v["Pods"]], "NumPDBViolations": v["NumPDBViolations"]}
        for n, v in body["NodeNameToVictims"].items()}
    assert out["NodeNameToMetaVictims"] == victims


@pytest.mark.parametrize(("verb", "body", "needle"), [
    ("filter", b"{", "not valid JSON"),
    ("filter", b"[]", "body must be a JSON object"),
    ("filter", b"", "empty body"),
    ("prioritize", json.dumps({"Pod": {}, "NodeNames": [1, 2]}).encode(), "NodeNames must be an array of strings"),
    ("prioritize", json.dumps({"NodeNames": ["a"]}).encode(), "Pod is missing"),
    ("prioritize", json.dumps({"Pod": [], "NodeNames": ["a"]}).encode(), "Pod must be a JSON object"),
    ("filter", json.dumps({"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}).encode(), "metadata.name must be"),
    ("filter", json.dumps({"Pod": {"metadata": {"annotations": {"a": 1}}}, "NodeNames": []}).encode(), "annotations"),
    ("bind", json.dumps({"PodName": "p", "PodNamespace": "d", "PodUID": "u"}).encode(), "Node must be"),
    ("bind", json.dumps({"PodName": "p", "PodNamespace": "d", "PodUID": 3, "Node": "n"}).encode(), "PodUID"),
    ("preempt", json.dumps({"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": [{"UID": 1}]}}}).encode(), "UID"),
])
def test_malformed_bodies_get_400_with_a_message(standalone, verb: str, body: bytes, needle: str) -> None:
    with standalone(NODES) as (_, client):
        r = client.post(f"/{verb}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert needle in r.json()["Error"]
        assert client.get("/healthz").status_code == 200  # and it keeps serving
        metrics = client.get("/metrics").text
    assert f'gpu_extender_bad_requests_total{{verb="{verb}"}} 1.0' in metrics


def test_bodies_over_the_limit_get_413(standalone) -> None:
    with standalone(NODES, max_body_bytes=4096) as (_, client):
        big = cache_args(pod_json(gpus=1), [f"n{i}" for i in range(1000)])
        assert client.post("/filter", json=big).status_code == 413

        def chunks():  # no Content-Length: the limit holds on the streamed body too
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        r = client.post("/filter", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["Error"]
        ok = client.post("/filter", json=cache_args(pod_json(gpus=1), ["pcie"]))
    assert ok.status_code == 200 and ok.json()["NodeNames"] == ["pcie"]


def test_pod_problems_are_answered_in_the_body(standalone) -> None:
    pod = pod_json(gpus=1)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1500m"}}
    with standalone(NODES) as (_, client):
        f = client.post("/filter", json=cache_args(pod, NAMES)).json()
        p = client.post("/prioritize", json=cache_args(pod, NAMES)).json()
        bad = pod_json(gpus=2, annotations={f"{'gpu-topology.io'}/min-allreduce-gbps": "fast"})
        g = client.post("/filter", json=cache_args(bad, NAMES)).json()
    assert f["NodeNames"] == [] and "1500m" in f["Error"] and "whole" in f["Error"]
    assert p == [{"Host": n, "Score": 0} for n in NAMES]
    assert "min-allreduce-gbps" in g["Error"]


def test_openapi_describes_exactly_the_verb_bodies(standalone) -> None:
    with standalone(NODES) as (_, client):
        spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    schemas = spec["components"]["schemas"]

    def ref(op: dict, where: str) -> str:
        node = op["requestBody"] if where == "request" else op["responses"]["200"]
        return node["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]

    expect = {"/filter": ("ExtenderArgs", "ExtenderFilterResult"), "/prioritize": ("ExtenderArgs", "HostPriorityList"),
              "/bind": ("ExtenderBindingArgs", "ExtenderBindingResult"),
              "/preempt": ("ExtenderPreemptionArgs", "ExtenderPreemptionResult")}
    for path, (req, resp) in expect.items():
        op = paths[path]["post"]
        assert (ref(op, "request"), ref(op, "response")) == (req, resp)
        assert set(op["responses"]) == {"200", "400", "413"}
    assert set(schemas["ExtenderArgs"]["properties"]) == {"Pod", "Nodes", "NodeNames"}
    assert set(schemas["ExtenderFilterResult"]["required"]) == {"Nodes", "NodeNames", "FailedNodes",
                                                                 "FailedAndUnresolvableNodes", "Error"}
    assert schemas["HostPriorityList"]["type"] == "array"
    assert schemas["HostPriority"]["properties"]["Score"] == {"maximum": 10, "minimum": 0, "title": "Score",
                                                             "type": "integer"}
    assert set(schemas["ExtenderBindingArgs"]["required"]) == {"PodName", "PodNamespace", "PodUID", "Node"}
    assert schemas["Pod"].get("additionalProperties") is True  # unknown Kubernetes keys are allowed
    assert set(schemas["ExtenderPreemptionResult"]["properties"]) == {"NodeNameToMetaVictims"}


def test_health_readiness_and_metrics(standalone) -> None:
    with standalone(NODES) as (_, client):
        assert client.get("/healthz").text == "ok"
        assert client.get("/readyz").status_code == 200
        client.post("/filter", json=cache_args(pod_json(gpus=1), NAMES))
        client.post("/prioritize", json=cache_args(pod_json(gpus=1), NAMES))
        text = client.get("/metrics").text
    assert 'gpu_extender_requests_total{code="200",verb="filter"} 1.0' in text
    assert 'gpu_extender_request_seconds_count{verb="prioritize"} 1.0' in text
    assert "gpu_extender_cache_nodes 4.0" in text
    assert 'gpu_extender_filter_nodes_total{result="passed"} 4.0' in text


def test_prioritize_encodes_any_node_name(standalone) -> None:
    odd = ["a,b", 'quote"d', "ünï,cødé", "back\\slash", ""]
    with standalone(NODES) as (_, client):
        out = client.post("/prioritize", json=cache_args(pod_json(gpus=1), ["pcie", *odd])).json()
        empty = client.post("/prioritize", json=cache_args(pod_json(gpus=1), [])).json()
    assert out == [{"Host": "pcie", "Score": 10}] + [{"Host": n, "Score": 0} for n in odd]
    assert empty == []


def test_a_node_named_twice_is_answered_once(standalone) -> None:
    """Issue 14, item 7: duplicate names in NodeNames (or a NodeList) are not echoed back as duplicates."""
    pod = pod_json(gpus=2)
    with standalone(NODES) as (_, client):
        cache = client.post("/filter", json=cache_args(pod, ["a100-0", "pcie", "a100-0", "busy", "pcie"])).json()
        listed = client.post("/filter", json=list_args(pod, [node_item(n) for n in ("pcie", "a100-0", "pcie")]))
        scores = client.post("/prioritize", json=cache_args(pod, ["pcie", "a100-1", "pcie"])).json()
    assert cache["NodeNames"] == ["a100-0", "pcie", "busy"]
    assert [n["metadata"]["name"] for n in listed.json()["Nodes"]["items"]] == ["pcie", "a100-0"]
    assert [h["Host"] for h in scores] == ["pcie", "a100-1"]


def test_compressed_or_binary_bodies_get_a_clear_400(standalone) -> None:
    import gzip

    body = json.dumps(cache_args(pod_json(gpus=1), NAMES)).encode()
    with standalone(NODES) as (_, client):
        zipped = client.post("/filter", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        binary = client.post("/filter", content=b'{"Pod": "\xff\xfe"}')
    assert zipped.status_code == 400 and "gzip-compressed" in zipped.json()["Error"]
    assert binary.status_code == 400 and "not UTF-8" in binary.json()["Error"]
    assert "surrogates" not in zipped.text + binary.text


def test_node_names_kept_valid_still_check_every_other_list() -> None:
    """wire keeps the NodeNames lists it found valid (kube-scheduler repeats them): an equal list is the kept object,
    a list with a repeat or a non-string is judged afresh each time, however like a kept one it is."""
    from extender import wire

    def names(value: object) -> list[str]:
        return wire.extender_args({"Pod": {}, "NodeNames": value}).names

    first = names(["a", "b", "c"])
    assert names(["a", "b", "c"]) is first and first == ["a", "b", "c"]
    assert names(["a", "b", "a", "c"]) == ["a", "b", "c"]
    assert names(["a", "b", "a", "c"]) == ["a", "b", "c"]  # not kept: deduplicated again
    for bad in (["a", "b", 3], ["a", None, "c"], "a,b,c", [["a"], "b", "c"]):
        with pytest.raises(wire.BadRequest, match="NodeNames"):
            names(bad)
    assert names(["a", "b", "c"]) is first


def test_a_list_made_from_a_valid_one_is_kept_and_the_others_still_checked() -> None:
    from extender import wire

    passed = ["p", "q"]
    wire.known_valid(passed)
    assert wire.extender_args({"Pod": {}, "NodeNames": ["p", "q"]}).names is passed
    for n in range(wire.LAST_NAME_LISTS + 2):  # many other lists later, a list asked each time stays kept
        wire.extender_args({"Pod": {}, "NodeNames": [f"x{n}"]})
        assert wire.extender_args({"Pod": {}, "NodeNames": ["p", "q"]}).names is passed
    with pytest.raises(wire.BadRequest):
        wire.extender_args({"Pod": {}, "NodeNames": ["p", 1]})


KEPT = ["n-1", "n-2", "n-3"]
KEPT_TEXT = json.dumps(KEPT, separators=(",", ":"))
# bodies that end as kube-scheduler's do (NodeNames last), some with the kept array's text in other places
TRAPS = [t.replace("@", KEPT_TEXT).replace("#", KEPT_TEXT.replace('"', '\\"')) for t in (
    '{"Pod":{"metadata":{"name":"p"}},"Nodes":null,"NodeNames":@}',
    '{"Pod":{},"NodeNames":["x"],"NodeNames":@}',  # a key twice: the last one counts
    '{"NodeNames":null,"Pod":{"spec":{"NodeNames":@}}}',  # nested, not the root's
    '{"NodeNames":null,"z":[{"NodeNames":@}]}',
    '{"NodeNames":null,"Pod":{"a":"\\"NodeNames\\":#"}}',  # inside a string
    '{"Pod":{},"NodeNames":@}  \n',
    '["NodeNames",{"NodeNames":@}]',  # not an object at the root
    '{"Pod":{},"NodeNames":@',  # cut short
    '{"Pod":{"x":1,},"NodeNames":@}',  # invalid before the array
    '{"Pod":{},"NodeNames":@}'.replace("@", KEPT_TEXT.replace("n-3", "n-4")),
)]


@pytest.mark.parametrize("body", TRAPS)
def test_bodies_whose_names_are_a_kept_lists_text_decode_as_json_does(body: str) -> None:
    """wire.decode does not parse a trailing NodeNames array written as a kept list: it must still be what a full
    parse gives, the kept list object only where the root's NodeNames is that array, the same errors otherwise."""
    from extender import wire

    first = wire.decode(b'{"Pod":{},"Nodes":null,"NodeNames":' + KEPT_TEXT.encode() + b"}")
    kept = wire.extender_args(first).names
    try:
        expected = json.loads(body)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(wire.BadRequest, match="not valid JSON") as fast:
            wire.decode(body.encode())
        with pytest.raises(wire.BadRequest) as full:
            wire.bodies.decode(body.encode())
        assert str(fast.value) == str(full.value)
        return
    got = wire.decode(body.encode())
    assert got == expected
    if isinstance(expected, dict) and expected.get("NodeNames") == KEPT:
        assert got["NodeNames"] is kept  # found by the text, not parsed
        assert wire.extender_args(got).names is kept


def test_prioritize_finds_filters_passed_list_by_its_text() -> None:
    """The list a filter answer writes is what kube-scheduler sends back: its text decodes to that very list."""
    from extender import wire

    passed = ["p-1", "p-2"]
    wire.known_valid(passed, written=True)
    body = b'{"Pod":{},"Nodes":null,"NodeNames":["p-1","p-2"]}'
    assert wire.decode(body)["NodeNames"] is passed
    assert wire.extender_args(wire.decode(body)).names is passed
    assert wire.decode(b'{"Pod":{},"Nodes":null,"NodeNames":["p-1","p-2","p-3"]}')["NodeNames"] is not passed
