"""Fault scenarios of the scheduler extender in cluster mode: FakeKubeApi behind a relay the test can cut, the
extender under uvicorn on 127.0.0.1, everything over real HTTP. Each scenario ends with the state checked: what
filter offers, the reservations held, the plans on the fake's pods, and that no thread is left behind.

tests/extender/test_cluster.py already covers single injected 409/404/500 answers to a Binding, a retried bind after
the pod was bound, pods deleted or failed and reservations timing out (counts), a re-list after 410, and a graceful
restart with plans in flight (also under 1,000 concurrent binds). These add what it does not: the apiserver gone or
answering 500 to everything after the first sync, a Binding slower than the client timeout, 500s while re-listing,
a pod deleted while its Binding is in flight, the same bind sent twice at once, a node deleted under a reservation,
timed-out GPUs handed to the next pod, and a crash restart of a real `gpu-extender serve` process (SIGKILL while a
Binding is in flight at the apiserver).

Every scenario records the plans its fake ends with in LEDGER; the last test checks them all for a GPU planned twice.
"""

from __future__ import annotations

import contextlib
import re
import selectors
import signal
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan
from gputopo.kube import make_api_client
from tests.extender.conftest import A100, DGX1, running, topo
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod, set_state
from tests.helpers.processes import ExtenderProcess
from tests.helpers.scheduler import bind_body, cache_args
from tests.reliability.conftest import WAIT, ThreadBaseline

PLAN = f"{PREFIX}/plan"
API_TIMEOUT_S = 1.0  # the extender's per-request apiserver timeout in these scenarios
SYNC_OPTIONS = {"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.2}

# scenario -> ((node, GPU id) -> pods whose plan names it), filled by record_plans()
LEDGER: dict[str, dict[tuple[str, str], list[str]]] = {}


# -- helpers ------------------------------------------------------------------------------------------------------


class Relay:
    """A TCP relay in front of the fake apiserver. cut() is the apiserver going away: new connections are refused
    and open ones (watch streams, pooled keep-alives) are reset. restore() listens again on the same port."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.port = 0
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._stop = threading.Event()
        self._listener = listener
        self._spawn(self._accept, listener, self._stop)

    def cut(self) -> None:
        self._stop.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._join()

    close = cut

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name="test-relay", daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _join(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive() and t is not me]
                self._threads = alive
            if not alive:
                return
            for t in alive:
                t.join(WAIT)

    def _accept(self, listener: socket.socket, stop: threading.Event) -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                down, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self._target)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._conns.update((down, up))
            self._spawn(self._pump, down, up)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            with self._lock:
                self._conns.difference_update((a, b))
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Set up before the shared `fake` apiserver and checked after it stopped: every thread a scenario starts ends."""
    baseline = ThreadBaseline()
    yield
    baseline.assert_none_leaked()


@contextmanager
def cluster_extender(fake: FakeKubeApi, url: str | None = None, *, api_timeout_s: float = API_TIMEOUT_S,
                     **config: Any) -> Iterator[tuple[Extender, httpx.Client]]:
    """An extender in cluster mode against `fake` (through `url` when given), synced, served over HTTP."""
    api = make_api_client(host=url or fake.url, timeout_s=api_timeout_s)
    ext = Extender.cluster(api, ExtenderConfig(**config), sync_options=SYNC_OPTIONS)
    try:
        with running(ext) as client:
            assert ext.sync is not None and ext.sync.wait_synced(WAIT)
            assert fake.wait_for_watches(2), "both watch streams open"  # every scenario starts from steady state
            yield ext, client
    finally:
        api.close()


def filter_out(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()


def scores(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200
    return {h["Host"]: h["Score"] for h in r.json()}


def bind(client: httpx.Client, pod: dict[str, Any], node: str) -> str:
    r = client.post("/bind", json=bind_body(pod, node))
    assert r.status_code == 200
    return r.json()["Error"]


def uid(pod: dict[str, Any]) -> str:
    return pod["metadata"]["uid"]


def plans_on(fake: FakeKubeApi) -> dict[str, tuple[str, frozenset[str]]]:
    """uid -> (node, GPU ids) of every pod the fake holds with a plan annotation."""
    out = {}
    for p in fake.pods():
        text = (p["metadata"].get("annotations") or {}).get(PLAN)
        if text:
            plan = parse_plan(text)
            assert plan.node == p["spec"].get("nodeName"), "a plan travels with its Binding"
            out[p["metadata"]["uid"]] = (plan.node, plan.ids)
    return out


def record_plans(fake: FakeKubeApi, scenario: str) -> int:
    """Put the fake's plans in the ledger and check them: no GPU of a node in two plans. Returns how many."""
    taken: dict[tuple[str, str], list[str]] = {}
    plans = plans_on(fake)
    for u, (node, ids) in plans.items():
        for g in ids:
            taken.setdefault((node, g), []).append(u)
    LEDGER[scenario] = taken
    twice = {k: v for k, v in taken.items() if len(v) > 1}
    assert not twice, f"GPUs planned twice: {twice}"
    return len(plans)


def state_used(fake: FakeKubeApi, node: str) -> None:
    """The plugin publishes every planned GPU on `node` as used (what the kubelet's Allocate leads to)."""
    used = sorted({g for n, ids in plans_on(fake).values() if n == node for g in ids})
    set_state(fake, node, used, generation=len(used) + 2)


def wait_for(ext: Extender, predicate: Any) -> None:
    assert ext.cache.wait_for(predicate, WAIT), "the cache never reached the expected state"


# -- the apiserver goes away -------------------------------------------------------------------------------------


def test_apiserver_unreachable_after_sync(fake: FakeKubeApi) -> None:
    a, d = topo(A100), topo(DGX1)
    fake.add_node(k8s_node("n1", a, used=[0, 1]))
    fake.add_node(k8s_node("n2", d))
    p4, p8, late = fake.add_pod(k8s_pod("p4", 4)), fake.add_pod(k8s_pod("p8", 8)), fake.add_pod(k8s_pod("late", 2))
    relay = Relay(fake.url)
    try:
        with cluster_extender(fake, relay.url) as (ext, client):
            before_f, before_s = filter_out(client, p4, ["n1", "n2"]), scores(client, p4, ["n1", "n2"])
            assert ext.sync is not None
            watches = ext.sync.nodes.stats.watches + ext.sync.pods.stats.watches

            relay.cut()
            # answers come from the cache, unchanged
            assert filter_out(client, p4, ["n1", "n2"]) == before_f
            assert scores(client, p4, ["n1", "n2"]) == before_s
            assert client.get("/readyz").status_code == 200 and client.get("/healthz").text == "ok"
            # bind cannot reach the apiserver: Error, and the GPUs it chose are offered again
            error = bind(client, p8, "n2")
            assert "binding pod default/p8 to n2 failed" in error
            assert ext.reservations.count() == 0
            assert filter_out(client, p8, ["n2"])["NodeNames"] == ["n2"]
            # while it is away the cluster changes
            fake.add_node(k8s_node("n3", a))
            fake.delete_pod("default", "late")

            relay.restore()
            wait_for(ext, lambda: "n3" in ext.cache.nodes and uid(late) not in ext.cache.pods)
            assert ext.sync.nodes.stats.watches + ext.sync.pods.stats.watches > watches  # reconnected
            assert ext.sync.nodes.stats.errors + ext.sync.pods.stats.errors > 0
            assert bind(client, p8, "n2") == ""
            assert filter_out(client, p4, ["n1", "n2", "n3"])["NodeNames"] == ["n1", "n3"]
    finally:
        relay.close()
    assert record_plans(fake, "unreachable") == 1


def test_apiserver_answering_500_to_everything(fake: FakeKubeApi) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    fake.add_node(k8s_node("n2", a, used=[0, 1, 2, 3]))
    pods = [fake.add_pod(k8s_pod(f"p{i}", 4)) for i in range(3)]
    with cluster_extender(fake) as (ext, client):
        before = filter_out(client, pods[0], ["n1", "n2"]), scores(client, pods[0], ["n1", "n2"])
        assert ext.sync is not None
        fake.clear_requests()
        fake.fail_next(1_000_000, 500)  # every request from now on, watches included
        fake.drop_watches()
        assert fake.wait_for_requests(lambda r: "watch" in r.query, n=4)  # they keep trying
        assert (filter_out(client, pods[0], ["n1", "n2"]), scores(client, pods[0], ["n1", "n2"])) == before
        for p in pods:
            error = bind(client, p, "n1")
            assert "500 InternalError" in error and "binding pod" in error
        assert ext.reservations.count() == 0
        assert filter_out(client, pods[0], ["n1"])["NodeNames"] == ["n1"]
        assert client.get("/healthz").status_code == 200
        assert ext.sync.nodes.stats.errors > 0 and ext.sync.pods.stats.errors > 0
        assert ext.sync.nodes.stats.callback_errors == ext.sync.pods.stats.callback_errors == 0
    assert not any(p["spec"].get("nodeName") for p in fake.pods())
    assert record_plans(fake, "500-everywhere") == 0


def test_a_binding_slower_than_the_api_timeout(fake: FakeKubeApi) -> None:
    """The Binding is held at the apiserver past the client timeout: bind answers Error without waiting for it.
    The apiserver may still apply it, so its GPUs stay reserved until the outcome is known; when it lands the pod's
    plan is what holds them, and when the node's state shows them used nothing is left reserved."""
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    slow, eager, small = fake.add_pod(k8s_pod("slow", 8)), fake.add_pod(k8s_pod("eager", 8)), fake.add_pod(
        k8s_pod("small", 1))
    with cluster_extender(fake) as (ext, client):
        gate = fake.hold_next(1, path_regex="/pods/slow/binding")
        try:
            error = bind(client, slow, "n1")
            # answered while the apiserver still holds the request: the client timeout bounded the wait
            assert fake.pod("default", "slow")["spec"].get("nodeName") is None
            assert "binding pod default/slow to n1 failed" in error and "timed out" in error.lower()
            # the Binding may still land: its GPUs are not handed to anyone else meanwhile
            assert "cannot take pod" in bind(client, eager, "n1")
            assert "reserved for pods being bound" in filter_out(client, small, ["n1"])["FailedNodes"]["n1"]
        finally:
            gate.set()
        wait_for(ext, lambda: (rec := ext.cache.pods.get(uid(slow))) is not None and rec.node == "n1")
        node, ids = plans_on(fake)[uid(slow)]
        assert node == "n1" and len(ids) == 8
        assert [(r.uid, r.ids) for r in ext.reservations.all()] == [(uid(slow), ids)]
        # a retry by the scheduler is answered consistently
        assert bind(client, slow, "n1") == ""
        state_used(fake, "n1")
        wait_for(ext, lambda: ext.reservations.count() == 0)
        assert "cannot take pod" in bind(client, eager, "n1")
    assert record_plans(fake, "slow-binding") == 1


def test_a_504_keeps_the_gpus_reserved_until_the_reservation_times_out(fake: FakeKubeApi) -> None:
    """504 is the apiserver saying it may still apply the request: the plan's GPUs stay reserved. This Binding was
    never applied, so the reservation times out and the GPUs go to the next pod."""
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    first, second = fake.add_pod(k8s_pod("first", 8)), fake.add_pod(k8s_pod("second", 8))
    with cluster_extender(fake, reservation_timeout_s=0.3) as (ext, client):
        fake.fail_next(1, 504, path_regex="/pods/first/binding")
        error = bind(client, first, "n1")
        assert "504 Timeout" in error and "stay reserved" in error
        assert fake.pod("default", "first")["spec"].get("nodeName") is None
        wait_for(ext, lambda: ext.reservations.count() == 0)  # timed out
        assert filter_out(client, second, ["n1"])["NodeNames"] == ["n1"]
        assert bind(client, second, "n1") == ""
        assert 'gpu_extender_reservations_ended_total{why="timeout"} 1.0' in client.get("/metrics").text
        assert 'gpu_extender_bind_total{outcome="outcome_unknown"} 1.0' in client.get("/metrics").text
    assert record_plans(fake, "504-then-timeout") == 1


NODE_LIST = r"^/api/v1/nodes(\?(?!.*watch=).*)?$"
NODE_WATCH = r"^/api/v1/nodes\?.*watch=true"


def test_relist_after_410_survives_500s_and_converges(fake: FakeKubeApi) -> None:
    a, d = topo(A100), topo(DGX1)
    fake.add_node(k8s_node("n1", a))
    fake.add_node(k8s_node("n3", d))
    pod = fake.add_pod(k8s_pod("p", 8))
    with cluster_extender(fake) as (ext, client):
        assert ext.sync is not None
        stats = ext.sync.nodes.stats
        lists, relists, errors = stats.lists, stats.relists, stats.errors
        # the node watch reconnects into a held request that will answer 410; the re-list then fails three times
        gate = fake.hold_next(1, path_regex=NODE_WATCH)
        fake.fail_next(1, 410, path_regex=NODE_WATCH)
        fake.fail_next(3, 500, path_regex=NODE_LIST)
        fake.clear_requests()
        assert fake.drop_watches() == 2
        assert fake.wait_for_requests(lambda r: r.path == "/api/v1/nodes" and "watch" in r.query)
        # no node stream is open: these changes reach the extender only through the re-list
        fake.add_node(k8s_node("n2", a))
        fake.update_node("n1", {"spec": {"unschedulable": True}})
        fake.delete_node("n3")
        stale = filter_out(client, pod, ["n1", "n2", "n3"])
        assert stale["NodeNames"] == ["n1", "n3"]  # answered from the cache meanwhile
        gate.set()
        wait_for(ext, lambda: "n2" in ext.cache.nodes and "n3" not in ext.cache.nodes
                 and ext.cache.nodes["n1"].unschedulable)
        out = filter_out(client, pod, ["n1", "n2", "n3"])
        assert out["NodeNames"] == ["n2"]
        assert "cordoned" in out["FailedAndUnresolvableNodes"]["n1"]
        assert "unknown" in out["FailedAndUnresolvableNodes"]["n3"]
        assert stats.relists == relists + 1 and stats.errors >= errors + 3 and stats.lists == lists + 1
        node_lists = [r for r in fake.requests if r.path == "/api/v1/nodes" and "watch" not in r.query]
        assert len(node_lists) == 4  # three refused, the fourth served
        assert fake.wait_for_watches(2)  # both streams open again
        assert bind(client, pod, "n2") == ""
    assert record_plans(fake, "relist-500") == 1


def test_pod_deleted_while_its_binding_is_in_flight_or_before_allocate(fake: FakeKubeApi) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    gone, early, later = (fake.add_pod(k8s_pod(n, 8)) for n in ("gone", "early", "later"))
    with cluster_extender(fake, api_timeout_s=WAIT) as (ext, client), ThreadPoolExecutor(1) as pool:
        gate = fake.hold_next(1, path_regex="/pods/gone/binding")
        answer = pool.submit(bind, client, gone, "n1")
        assert fake.wait_for_requests(lambda r: r.path.endswith("/pods/gone/binding"))
        assert [r.uid for r in ext.reservations.all()] == [uid(gone)]
        fake.delete_pod("default", "gone")
        gate.set()
        assert "not found: it was deleted" in answer.result(WAIT)
        wait_for(ext, lambda: ext.reservations.count() == 0)
        assert filter_out(client, early, ["n1"])["NodeNames"] == ["n1"]

        # bound, then deleted before the kubelet ran it: its reservation ends, the GPUs are offered again
        assert bind(client, early, "n1") == ""
        assert "reserved for pods being bound" in filter_out(client, later, ["n1"])["FailedNodes"]["n1"]
        fake.delete_pod("default", "early")
        wait_for(ext, lambda: ext.reservations.count() == 0)
        assert filter_out(client, later, ["n1"])["NodeNames"] == ["n1"]
        assert bind(client, later, "n1") == ""
        text = client.get("/metrics").text
    assert re.search(r'gpu_extender_reservations_ended_total\{why="pod_gone"\} [12]\.0', text), text
    assert record_plans(fake, "pod-deleted") == 1


def test_the_same_bind_sent_twice_at_once(fake: FakeKubeApi) -> None:
    d = topo(DGX1)
    fake.add_node(k8s_node("n1", d))
    pod, other = fake.add_pod(k8s_pod("twice", 4)), fake.add_pod(k8s_pod("other", 4))
    with cluster_extender(fake, api_timeout_s=WAIT) as (ext, client), ThreadPoolExecutor(1) as pool:
        gate = fake.hold_next(1, path_regex="/pods/twice/binding")
        first = pool.submit(bind, client, pod, "n1")
        assert fake.wait_for_requests(lambda r: r.path.endswith("/pods/twice/binding"))
        assert bind(client, pod, "n1") == ""  # the second attempt reuses the first one's plan and lands
        gate.set()
        assert first.result(WAIT) == ""  # 409 for the first: the pod sits on n1 with this very plan
        node, ids = plans_on(fake)[uid(pod)]
        assert node == "n1" and [(r.uid, r.ids) for r in ext.reservations.all()] == [(uid(pod), ids)]
        posts = [r for r in fake.requests if r.method == "POST"]
        assert len(posts) == 2
        assert bind(client, pod, "n1") == ""  # and a third, once the cache shows it bound
        assert bind(client, other, "n1") == ""
        state_used(fake, "n1")
        wait_for(ext, lambda: ext.reservations.count() == 0)
    assert record_plans(fake, "bind-twice") == 2


def test_a_node_deleted_under_a_reservation(fake: FakeKubeApi) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    fake.add_node(k8s_node("n2", a))
    held, p, q = fake.add_pod(k8s_pod("held", 6)), fake.add_pod(k8s_pod("p", 4)), fake.add_pod(k8s_pod("q", 4))
    with cluster_extender(fake) as (ext, client):
        assert bind(client, held, "n1") == ""
        fake.delete_node("n1")
        wait_for(ext, lambda: "n1" not in ext.cache.nodes)
        out = filter_out(client, p, ["n1", "n2"])
        assert out["NodeNames"] == ["n2"] and "unknown" in out["FailedAndUnresolvableNodes"]["n1"]
        assert scores(client, p, ["n1", "n2"])["n1"] == 0
        fake.clear_requests()
        error = bind(client, p, "n1")
        assert "cannot take pod default/p" in error and "unknown" in error
        assert not [r for r in fake.requests if r.method == "POST"]  # no Binding for a node that is gone
        assert [r.uid for r in ext.reservations.all()] == [uid(held)]
        # the node registers again with a fresh state: the plan bound to it still holds its GPUs
        fake.add_node(k8s_node("n1", a))
        wait_for(ext, lambda: "n1" in ext.cache.nodes)
        assert filter_out(client, p, ["n1"])["FailedNodes"]["n1"].startswith("needs 4 GPUs, 2 free")
        # until the pod is gone (the pod garbage collector deletes pods of deleted nodes)
        fake.delete_pod("default", "held")
        wait_for(ext, lambda: ext.reservations.count() == 0)
        assert bind(client, p, "n1") == "" and bind(client, q, "n1") == ""
    assert record_plans(fake, "node-deleted") == 2


def test_crash_restart_with_a_binding_in_flight(fake: FakeKubeApi, tmp_path: Path) -> None:
    """Extender A (a real process) binds pods, then is killed with SIGKILL while one Binding is still held at the
    apiserver; that Binding lands after A is gone. Extender B starts on the same apiserver before the node states
    show any plan used: it rebuilds every in-flight plan from the pods' annotations, and binding many more pods
    through B never plans a GPU twice."""
    a, d = topo(A100), topo(DGX1)
    names = ["a0", "a1", "d0", "d1"]
    for n in names:
        fake.add_node(k8s_node(n, a if n.startswith("a") else d))
    pods = [fake.add_pod(k8s_pod(f"p{i}", [1, 2, 4, 1][i % 4])) for i in range(40)]
    first, flying, rest = pods[:10], pods[10], pods[11:]
    A = ExtenderProcess(fake.url, tmp_path / "a.log", WAIT)
    try:
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda k: bind(A.http, first[k], names[k % 4]), range(10))) == [""] * 10
            gate = fake.hold_next(1, path_regex="/pods/p10/binding")
            pending = pool.submit(lambda: A.http.post("/bind", json=bind_body(flying, "a0")))
            assert fake.wait_for_requests(lambda r: r.path.endswith("/pods/p10/binding"))
            assert A.stop(signal.SIGKILL) == -signal.SIGKILL
            with pytest.raises(httpx.HTTPError):
                pending.result(WAIT)  # the connection went with the process
    finally:
        A.stop(signal.SIGKILL)
    gate.set()
    assert fake.wait_until(lambda: bool((fake.pod("default", "p10") or {}).get("spec", {}).get("nodeName")))
    assert len(plans_on(fake)) == 11  # the ten A answered, and the one that landed after A died
    B = ExtenderProcess(fake.url, tmp_path / "b.log", WAIT)
    try:
        assert B.gauge("gpu_extender_reservations") == 11.0
        with ThreadPoolExecutor(16) as pool:
            errors = list(pool.map(lambda k: bind(B.http, rest[k], names[k % 4]), range(len(rest))))
        assert all(e == "" or "cannot take pod" in e for e in errors), errors
        assert B.http.get("/healthz").status_code == 200
    finally:
        assert B.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful shutdown
    log = (tmp_path / "b.log").read_text()
    assert "extender.reservation.rebuilt" in log and "extender.service.stopped" in log
    assert record_plans(fake, "crash-restart") == 11 + errors.count("") > 11
    placed = Counter(n for n, _ in plans_on(fake).values())
    assert sum(placed.values()) <= 32  # four 8-GPU nodes


def test_zero_gpus_planned_twice_across_the_scenarios() -> None:
    """Runs last: every scenario above left its plans in LEDGER (a run of a subset checks that subset)."""
    if not LEDGER:
        pytest.skip("no scenario ran in this session")
    twice = {(scenario, gpu): pods for scenario, taken in LEDGER.items() for gpu, pods in taken.items()
             if len(pods) > 1}
    assert not twice, f"GPUs planned twice: {twice}"
    assert sum(len(taken) for taken in LEDGER.values()) > 0  # GPUs planned over all scenarios
