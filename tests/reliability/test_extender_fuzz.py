"""Bad input for the scheduler extender, bounded for CI: hand-made nasties over real HTTP, schemathesis where
tests/extender/test_openapi_fuzz.py does not reach, and garbage annotations served by the fake apiserver.

test_openapi_fuzz.py already runs schemathesis (positive and negative) on the four verbs of a standalone extender.
This adds: the same verbs in cluster mode (bind reaches the apiserver), every other operation of the schema, the
bodies no schema generator makes (20 MiB, 10,000 levels of nesting, non-UTF-8, NaN, duplicated keys, huge integers,
100,000 nodes, every field of the recorded kube-scheduler bodies given a wrong type or null, broken HTTP framing),
and annotations on Nodes and Pods written by someone else. The promise checked everywhere: no 5xx, no verb reaching
its internal-error path, every answer valid for its verb, the server alive afterwards.

The catalogue (`nasties`), the oracle (`check_answer`) and the sender (`send`) are public: bench/fuzz_extender.py
runs them at scale against a `gpu-extender serve` process.
"""

from __future__ import annotations

import copy
import json
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pydantic
import pytest
import schemathesis
import structlog
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from extender.config import ExtenderConfig
from extender.http import models
from extender.service import Extender
from gputopo.contract import PlanFormatError, parse_plan
from gputopo.core import TopologyError, state_from_json, topology_from_json, topology_to_json
from tests.extender.conftest import A100, DGX1, H100X4, PCIE, running, topo
from tests.extender.conftest import write_inventory as _write_inventory
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod, node_annotations
from tests.helpers.scheduler import recorded
from tests.reliability.conftest import WAIT, ThreadBaseline
from tests.reliability.test_extender_faults import cluster_extender

JSON = "application/json"
VERBS = ("filter", "prioritize", "bind", "preempt")
ANSWERS: dict[str, Any] = {"filter": models.ExtenderFilterResult, "prioritize": models.HostPriorityList,
                           "bind": models.ExtenderBindingResult, "preempt": models.ExtenderPreemptionResult}
RECORDED_BODIES = {
    "filter": ("filter.json", "filter-nodecache.json"),
    "prioritize": ("prioritize.json", "prioritize-nodecache.json"),
    "bind": ("bind.json", "bind-nodecache.json"),
    "preempt": ("preempt.json", "preempt-nodecache.json"),
}
# The nodes the recorded bodies name, as a standalone inventory: mixed fabrics, some GPUs used or unhealthy.
INVENTORY = [
    {"name": "gpu-node-1", "topology": A100},
    {"name": "gpu-node-2", "topology": DGX1, "used": [0]},
    {"name": "gpu-node-3", "topology": PCIE},
    {"name": "gpu-node-4", "topology": H100X4, "unhealthy": [3]},
    {"name": "gpu-node-5", "topology": A100, "used": [0, 1, 2, 3]},
]
# What a field can be given instead of its value: every JSON type, edge numbers, hostile strings.
WRONG_VALUES: tuple[Any, ...] = (
    None, True, 0, -1, 1.5, 2**64, -(2**63) - 1, 1e308, "", "x", "\u0000", "🙂" * 50, [], [None], {}, {"": None},
)
BIG = 20 * 1024 * 1024
INTERNAL = "gpu-extender internal error in "  # how extender/http/answers.py words an unexpected exception


def write_inventory(path: Path) -> Path:
    return _write_inventory(path, INVENTORY)


@dataclass(frozen=True)
class Nasty:
    """One hand-made request. `raw` is sent as-is over a socket (broken HTTP framing), then the socket's sending
    side is closed when `hang_up`; otherwise `body` goes by httpx, in `chunk`-byte pieces without Content-Length
    when chunk > 0."""

    label: str
    path: str
    body: bytes = b""
    method: str = "POST"
    content_type: str | None = JSON
    chunk: int = 0
    raw: bytes | None = None
    hang_up: bool = False


@dataclass
class Tally:
    """What a fuzzing run saw: per-endpoint status counts, broken promises, the slowest answer."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    cases: int = 0
    slowest: tuple[float, str] = (0.0, "")
    seconds: dict[str, list[float]] = field(default_factory=dict)  # endpoint -> every answer's time
    slowest_by_endpoint: dict[str, tuple[float, str]] = field(default_factory=dict)

    def note(self, endpoint: str, status: int, seconds: float, label: str, problems: list[str]) -> None:
        self.cases += 1
        self.statuses[(endpoint, status)] += 1
        self.problems.extend(f"{label}: {p}" for p in problems)
        self.seconds.setdefault(endpoint, []).append(seconds)
        if seconds > self.slowest[0]:
            self.slowest = (seconds, label)
        if seconds > self.slowest_by_endpoint.get(endpoint, (0.0, ""))[0]:
            self.slowest_by_endpoint[endpoint] = (seconds, label)

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)


# -- the catalogue -------------------------------------------------------------------------------------------------


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # json, not orjson: keeps 2**64 and NaN as written


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _replace(body: Any, path: tuple[Any, ...], new: Any) -> Any:
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return out


def _all_null(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _all_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_all_null(v) for v in value]
    return None


def _nest(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def _with_deep_node_item(depth: int) -> bytes:
    body = recorded("filter.json")
    item = body["Nodes"]["items"][0]  # gpu-node-1: fits the pod, so filter sends the item back
    item["metadata"]["labels"]["deep"] = "x"
    text = json.dumps(body)
    return text.replace('"deep": "x"}', '"deep": "x"}, "nested": ' + _nest(depth), 1).encode()


def field_mutations(rng: random.Random, limit: int | None) -> Iterator[Nasty]:
    """Every field of every recorded body replaced by each wrong value (a seeded sample of `limit` when given)."""
    cases = []
    for verb, names in RECORDED_BODIES.items():
        for name in names:
            body = recorded(name)
            for path in _paths(body):
                for value in WRONG_VALUES:
                    cases.append((verb, name, path, value))
    if limit is not None and limit < len(cases):
        cases = rng.sample(cases, limit)
    for verb, name, path, value in cases:
        where = ".".join(map(str, path))
        yield Nasty(f"{name} {where}={value!r:.20}", f"/{verb}", _dumps(_replace(recorded(name), path, value)))


def nasties(rng: random.Random, mutations: int | None = 200) -> Iterator[Nasty]:
    """The hand-made catalogue; `mutations` bounds the wrong-type/null field replacements (None: all of them)."""
    many = [f"unknown-{i}" for i in range(100_000)]
    pod = recorded("filter-nodecache.json")["Pod"]
    for verb in VERBS:
        path = f"/{verb}"
        base = recorded(RECORDED_BODIES[verb][1])
        yield Nasty(f"{verb}: 20 MiB body", path, b'{"Pod": {}, "x": "' + b"x" * BIG + b'"}')
        yield Nasty(f"{verb}: 20 MiB chunked body", path, b'{"Pod": {}, "x": "' + b"x" * BIG + b'"}', chunk=1 << 16)
        yield Nasty(f"{verb}: 10,000 levels of nesting", path, _nest(10_000).encode())
        yield Nasty(f"{verb}: Pod nested 10,000 levels", path, b'{"Pod": ' + _nest(10_000, "{}").encode() + b"}")
        yield Nasty(f"{verb}: 1,000 levels under an unknown Pod key", path,
                    _dumps({**base, "Pod": {**pod, "extra": None}}).replace(b'"extra": null',
                                                                             b'"extra": ' + _nest(1000).encode()))
        yield Nasty(f"{verb}: every value null", path, _dumps(_all_null(base)))
        yield Nasty(f"{verb}: empty body", path, b"")
        yield Nasty(f"{verb}: whitespace", path, b" \n\t ")
        for literal in (b"null", b"[]", b'""', b"0", b"true", b"NaN", b"Infinity", b"-Infinity", b"1e400"):
            yield Nasty(f"{verb}: body {literal.decode()}", path, literal)
        yield Nasty(f"{verb}: NaN inside", path, _dumps(base).replace(b"{", b'{"n": NaN, ', 1))
        yield Nasty(f"{verb}: Infinity inside", path, _dumps(base).replace(b"{", b'{"n": -Infinity, ', 1))
        yield Nasty(f"{verb}: non-UTF-8 bytes", path, _dumps(base).replace(b'"default"', b'"\xff\xfe\xc0\xaf"'))
        yield Nasty(f"{verb}: lone surrogate", path, _dumps(base).replace(b'"default"', b'"\\ud800"'))
        yield Nasty(f"{verb}: NUL in strings", path, _dumps(base).replace(b'"default"', b'"de\\u0000fault"'))
        yield Nasty(f"{verb}: UTF-8 BOM", path, b"\xef\xbb\xbf" + _dumps(base))
        yield Nasty(f"{verb}: trailing garbage", path, _dumps(base) + b" }{")
        yield Nasty(f"{verb}: truncated", path, _dumps(base)[: len(_dumps(base)) // 2])
        yield Nasty(f"{verb}: duplicated keys", path, b'{"Pod": [], ' + _dumps(base)[1:])
        yield Nasty(f"{verb}: duplicated keys, last wins", path, _dumps(base)[:-1] + b', "Pod": null}')
        yield Nasty(f"{verb}: huge integers", path, re.sub(rb'"(\d+)"', rb"1" + b"0" * 40, _dumps(base)))
        yield Nasty(f"{verb}: 2**64 everywhere", path, re.sub(rb"\b\d+\b", str(2**64).encode(), _dumps(base)))
        yield Nasty(f"{verb}: text/plain", path, _dumps(base), content_type="text/plain")
        yield Nasty(f"{verb}: form content-type", path, _dumps(base), content_type="application/x-www-form-urlencoded")
        yield Nasty(f"{verb}: no content-type", path, _dumps(base), content_type=None)
        yield Nasty(f"{verb}: GET", path, method="GET")
        yield Nasty(f"{verb}: PUT", path, _dumps(base), method="PUT")
        yield Nasty(f"{verb}: Content-Length beyond any body", path,
                    raw=f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                        f"{10**30}\r\n\r\n{{}}".encode())
        yield Nasty(f"{verb}: negative Content-Length", path,
                    raw=f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{{}}".encode())
        yield Nasty(f"{verb}: bad chunk size", path,
                    raw=f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n"
                        .encode())
        yield Nasty(f"{verb}: body cut short", path,
                    raw=f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{\"Pod\":".encode(),
                    hang_up=True)
    names_body = {"Pod": pod, "Nodes": None, "NodeNames": many}
    yield Nasty("filter: 100,000 unknown nodes", "/filter", _dumps(names_body))
    yield Nasty("prioritize: 100,000 unknown nodes", "/prioritize", _dumps(names_body))
    yield Nasty("filter: 100,000 copies of one node", "/filter", _dumps({**names_body, "NodeNames": ["gpu-node-1"] *
                                                                         100_000}))
    yield Nasty("preempt: 100,000 unknown candidates", "/preempt", _dumps({"Pod": pod, "NodeNameToMetaVictims": {
        n: {"Pods": [{"UID": n}], "NumPDBViolations": 0} for n in many}}))
    yield Nasty("filter: NodeList of 20,000 unknown nodes", "/filter", _dumps({"Pod": pod, "NodeNames": None, "Nodes": {
        "items": [{"metadata": {"name": n}} for n in many[:20_000]]}}))
    yield Nasty("filter: kept node nested 300 levels deep", "/filter", _with_deep_node_item(300))
    yield Nasty("filter: kept node nested 1,000 levels deep", "/filter", _with_deep_node_item(1000))
    yield Nasty("bind: unknown node", "/bind", _dumps({**recorded("bind.json"), "Node": "no-such-node"}))
    yield Nasty("bind: 1 MB names", "/bind", _dumps({"PodName": "p" * 10**6, "PodNamespace": "n" * 10**6,
                                                     "PodUID": "u" * 10**6, "Node": "gpu-node-1"}))
    yield Nasty("filter: 10,000 containers of 4,096 GPUs", "/filter", _dumps({
        "Pod": {**pod, "spec": {"containers": [{"name": f"c{i}", "resources": {"limits": {"nvidia.com/gpu": "4096"}}}
                                               for i in range(10_000)]}}, "NodeNames": ["gpu-node-1"]}))
    yield Nasty("filter: quantity 1e30", "/filter", _dumps({"Pod": {**pod, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1e30}}}]}}, "NodeNames": ["gpu-node-1"]}))
    yield Nasty("preempt: NumPDBViolations 2**64", "/preempt",
                _dumps({"Pod": pod, "NodeNameToMetaVictims": {"gpu-node-5": {"Pods": [], "NumPDBViolations": 2**64}}}))
    yield Nasty("GET /nowhere", "/nowhere", method="GET")
    yield Nasty("DELETE a pod that was never bound", "/inventory/pods/%00%2F..%2F", method="DELETE")
    yield from field_mutations(rng, mutations)


# -- the oracle ----------------------------------------------------------------------------------------------------


def _request_names(request: Any) -> list[str] | None:
    if not isinstance(request, dict):
        return None
    names = request.get("NodeNames")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return names
    nodes = request.get("Nodes")
    if names is None and isinstance(nodes, dict) and isinstance(nodes.get("items"), list):
        try:
            return [i["metadata"]["name"] for i in nodes["items"]]
        except (KeyError, TypeError):
            return None
    return None


def check_answer(path: str, method: str, body: bytes, status: int, content: bytes) -> list[str]:
    """What is wrong with this answer (empty: nothing). A verb answers 200 with a body valid for it, or 400/413 with
    an Error; nothing ever answers 5xx; a 200 never carries the internal-error message."""
    if status >= 500:
        return [f"HTTP {status}: {content[:200]!r}"]
    verb = path.strip("/")
    if verb not in VERBS:
        return []
    if method != "POST":
        return [] if status == 405 else [f"{method} answered {status}, expected 405"]
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return [f"HTTP {status} with a body that is not JSON: {content[:200]!r}"]
    if status in (400, 413):
        ok = isinstance(answer, dict) and isinstance(answer.get("Error"), str) and answer["Error"]
        return [] if ok else [f"HTTP {status} without an Error: {content[:200]!r}"]
    if status != 200:
        return [f"unexpected HTTP {status}: {content[:200]!r}"]
    try:
        ANSWERS[verb].model_validate(answer)
    except pydantic.ValidationError as e:
        return [f"200 body not a valid {ANSWERS[verb].__name__}: {e}"[:400]]
    error = answer.get("Error", "") if isinstance(answer, dict) else ""
    if error.startswith(INTERNAL):
        return [f"the verb hit its internal-error path: {error[:300]}"]
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    names = _request_names(request)
    if names is None or error:
        return []
    names = list(dict.fromkeys(names))  # a node named twice is answered once (issue 14)
    if verb == "prioritize" and [h["Host"] for h in answer] != names:
        return ["prioritize did not score exactly the nodes asked, in order"]
    if verb == "filter":
        judged = set(answer["FailedNodes"]) | set(answer["FailedAndUnresolvableNodes"])
        passed = answer["NodeNames"] if answer["NodeNames"] is not None else [
            i["metadata"]["name"] for i in (answer["Nodes"] or {}).get("items") or []]
        if judged | set(passed) != set(names) or set(passed) & judged:
            return ["filter's passed, failed and unresolvable nodes do not partition the nodes asked"]
    return []


def _raw(base_url: str, data: bytes, hang_up: bool) -> tuple[int, bytes]:
    """Send bytes on a fresh connection; the status (0: the server closed without answering) and the body."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        s.sendall(data)
        if hang_up:
            s.shutdown(socket.SHUT_WR)  # the client goes away mid-body
        chunks = []
        try:
            while True:
                got = s.recv(1 << 16)
                if not got:
                    break
                chunks.append(got)
                if b"\r\n\r\n" in b"".join(chunks):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    reply = b"".join(chunks)
    m = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    return (int(m.group(1)) if m else 0), reply.partition(b"\r\n\r\n")[2]


def send(client: httpx.Client, nasty: Nasty, tally: Tally) -> None:
    """Send one nasty and judge the answer into `tally`; the time is the round trip alone, not the judging."""
    if nasty.raw is not None:
        started = time.perf_counter()
        status, content = _raw(str(client.base_url).rstrip("/"), nasty.raw, nasty.hang_up)
        seconds = time.perf_counter() - started
        problems = [f"HTTP {status}"] if status >= 500 else []
    else:
        headers = {"content-type": nasty.content_type} if nasty.content_type else {}
        body: Any = nasty.body if nasty.body else None
        if nasty.chunk:
            data = nasty.body
            body = (data[i:i + nasty.chunk] for i in range(0, len(data), nasty.chunk))
        started = time.perf_counter()
        r = client.request(nasty.method, nasty.path, content=body, headers=headers)
        seconds = time.perf_counter() - started
        status, content = r.status_code, r.content
        problems = check_answer(nasty.path, nasty.method, nasty.body, status, content)
    tally.note(nasty.path, status, seconds, nasty.label, problems)


def assert_alive_and_clean(client: httpx.Client) -> None:
    assert client.get("/healthz").text == "ok"
    metrics = client.get("/metrics").text
    assert "gpu_extender_internal_errors_total{" not in metrics, re.findall(r"internal_errors_total\{.*", metrics)


# -- tests ---------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Set up before the shared `fake` apiserver and checked after it stopped: every thread a test starts ends."""
    baseline = ThreadBaseline()
    yield
    baseline.assert_none_leaked()


def test_hand_made_nasties_over_http(tmp_path: Path) -> None:
    ext = Extender.standalone(write_inventory(tmp_path / "inv.yaml"), ExtenderConfig())
    tally = Tally()
    with running(ext) as client:
        for nasty in nasties(random.Random(7), mutations=250):
            send(client, nasty, tally)
        assert_alive_and_clean(client)
    assert tally.problems == []
    assert tally.server_errors == 0
    codes = Counter(status for (_, status) in tally.statuses.elements())
    assert codes[413] >= 8 and codes[400] > 50 and codes[200] > 50 and codes[405] >= 4  # every kind of answer seen


def test_schemathesis_on_every_other_operation(tmp_path: Path) -> None:
    """The health, metrics and inventory operations (the verbs are test_openapi_fuzz.py's): never a 5xx."""
    ext = Extender.standalone(write_inventory(tmp_path / "inv.yaml"), ExtenderConfig())
    with running(ext) as client:
        schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
        base = str(client.base_url)
        for path, method in (("/healthz", "GET"), ("/readyz", "GET"), ("/metrics", "GET"), ("/inventory", "GET"),
                             ("/inventory/pods/{uid}", "DELETE")):
            operation = schema[path][method]  # positive only: a path string or no input at all cannot be broken

            @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=base, checks=[not_a_server_error])

            check()
        assert_alive_and_clean(client)


def test_schemathesis_on_the_verbs_in_cluster_mode(fake: FakeKubeApi) -> None:
    """Bind reaches the apiserver here (pods that do not exist, names the apiserver refuses), filter and
    prioritize read a cache fed by watches."""
    d = topo(DGX1)
    for i in range(1, 6):
        fake.add_node(k8s_node(f"gpu-node-{i}", d, used=[0] if i == 2 else []))
    fake.add_pod(k8s_pod("gpu-pod-a", 2))
    with cluster_extender(fake, api_timeout_s=WAIT, max_body_bytes=64 * 1024) as (_, client):
        schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
        base = str(client.base_url)
        for verb in VERBS:
            operation = schema[f"/{verb}"]["POST"]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @seed(11)
                @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case: schemathesis.Case) -> None:
                    case.call_and_validate(base_url=base)

                check()
        assert_alive_and_clean(client)


# -- annotations written by someone else ---------------------------------------------------------------------------

TOPOLOGY_KEY, STATE_KEY, PLAN_KEY = f"{PREFIX}/topology", f"{PREFIX}/state", f"{PREFIX}/plan"
UTF8 = st.characters(codec="utf-8")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(UTF8, max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(UTF8, max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _mutated(valid: str) -> st.SearchStrategy[str]:
    """The valid annotation with one value replaced, one key dropped, or cut short."""
    data = json.loads(valid)
    paths = list(_paths(data))

    def replace(i: int, value: Any) -> str:
        return json.dumps(_replace(data, paths[i], value))

    def drop(i: int) -> str:
        out = copy.deepcopy(data)
        target = out
        for key in paths[i][:-1]:
            target = target[key]
        del target[paths[i][-1]]
        return json.dumps(out)

    index = st.integers(0, len(paths) - 1)
    return st.one_of(st.builds(replace, index, JSON_VALUES), st.builds(drop, index),
                     st.integers(0, len(valid) - 1).map(lambda n: valid[:n]))


def garbage(valid: str) -> st.SearchStrategy[str]:
    return st.one_of(
        _mutated(valid),
        JSON_VALUES.map(lambda v: json.dumps(v)),  # NaN and Infinity included, as json writes them
        st.text(UTF8, max_size=40),
        st.sampled_from(["", "{}", "null", "[]", "{" * 100_000, "[" * 5000 + "]" * 5000, '{"v": 1e999}',
                         valid + valid, valid.upper()]),
    )


def _readable(kind: str, text: str) -> bool:
    """The core's own parsers decide what is readable; the extender must agree with them."""
    try:
        if kind == "topology":
            topology_from_json(text)
        elif kind == "state":
            state_from_json(text)
        else:
            parse_plan(text)
    except (TopologyError, PlanFormatError, RecursionError):
        return False
    return True


def test_garbage_annotations_from_the_apiserver_are_ignored_with_a_reason(fake: FakeKubeApi) -> None:
    """Nodes whose topology or state annotation is garbage publish no topology (unresolvable, reason logged);
    pods whose plan annotation is garbage hold no reservation (reason logged); the watches never fail."""
    d = topo(DGX1)
    valid = {"topology": topology_to_json(d), "state": node_annotations(d, used=["GPU1"])[STATE_KEY],
             "plan": json.dumps({"v": 1, "node": "base", "resource": "nvidia.com/gpu",
                                 "containers": {"main": ["GPU2", "GPU3"]}, "gbps": 100.0})}
    fake.add_node(k8s_node("base", d))
    probe = k8s_pod("probe", 1) | {"metadata": {"name": "probe", "namespace": "default", "uid": "probe"}}
    examples = iter(range(10**6))
    unreadable_nodes: list[str] = []
    items = st.lists(st.sampled_from(["topology", "state", "plan"]).flatmap(
        lambda kind: st.tuples(st.just(kind), garbage(valid[kind]))), min_size=1, max_size=6)

    with structlog.testing.capture_logs() as logs, cluster_extender(fake, api_timeout_s=WAIT) as (ext, client):
        assert ext.sync is not None

        @seed(5)
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(items)
        def check(batch: list[tuple[str, str]]) -> None:
            k = next(examples)
            nodes, pods = [], []
            rv = {"nodes": 0, "pods": 0}
            for j, (kind, text) in enumerate(batch):
                name = f"g{k}-{j}"
                if kind == "plan":
                    pod = fake.add_pod(k8s_pod(name, 1, node="base", annotations={PLAN_KEY: text}))
                    pods.append((pod["metadata"]["uid"], text))
                    rv["pods"] = int(pod["metadata"]["resourceVersion"])
                else:
                    node = k8s_node(name, d)
                    node["metadata"]["annotations"][TOPOLOGY_KEY if kind == "topology" else STATE_KEY] = text
                    rv["nodes"] = int(fake.add_node(node)["metadata"]["resourceVersion"])
                    nodes.append((name, kind, text))
            assert ext.cache.wait_for(lambda: all(
                int(getattr(ext.sync, kind).resource_version or 0) >= n for kind, n in rv.items()), WAIT)
            out = client.post("/filter", json={"Pod": probe, "NodeNames": [n for n, _, _ in nodes]}).json()
            for name, kind, text in nodes:
                reason = out["FailedAndUnresolvableNodes"].get(name, "")
                if text and not _readable(kind, text):
                    unreadable_nodes.append(name)
                    key = TOPOLOGY_KEY if kind == "topology" else STATE_KEY
                    assert f"annotation {key} is unreadable" in reason, (kind, text[:80], reason)
                    assert any(e["event"] == "extender.cache.ignored" and e["what"] == f"node/{name}" for e in logs)
                elif kind == "topology" and not text:
                    assert "missing" in reason
                else:
                    assert "unreadable" not in reason
            for uid, text in pods:
                if not _readable("plan", text):
                    rec = ext.cache.pods[uid]
                    assert rec.plan is None and all(r.uid != uid for r in ext.reservations.all())
                    assert any(e["event"] == "extender.cache.ignored" and e["what"] == f"pod/{uid}"
                               and "plan annotation ignored" in e["problem"] for e in logs)

        check()
        assert ext.sync.nodes.stats.callback_errors == ext.sync.pods.stats.callback_errors == 0
        gauge = re.search(r"^gpu_extender_cache_nodes_without_topology (\S+)$", client.get("/metrics").text, re.M)
        assert gauge and float(gauge.group(1)) >= len(unreadable_nodes) > 0
        assert_alive_and_clean(client)
