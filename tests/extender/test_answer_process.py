"""The answering process (extender.front): `gpu-extender serve` in cluster mode answers filter and prioritize in a
second process, from node states it streams there. Real processes against the fake apiserver: the answers are the
ones a single process gives, they follow node changes and reservations at once, everything else is passed on, and
either process going away is handled."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extender.front.channel import MAX_FRAME, ChannelClosed, frame, read_message
from tests.extender.conftest import A100, DGX1, topo
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod, node_annotations, set_state
from tests.helpers.polling import eventually
from tests.helpers.processes import ExtenderProcess, alive
from tests.helpers.scheduler import bind_body, cache_args, list_args, node_item

WAIT = 20.0
NAMES = ["a0", "a1", "d0", "d1"]
LOCAL = 'gpu_extender_answering_process_requests_total{verb="%s"}'


def filter_out(client: httpx.Client, pod: dict[str, Any], names: list[str] = NAMES) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200, r.text
    return r.json()


def scores(client: httpx.Client, pod: dict[str, Any], names: list[str] = NAMES) -> list[dict[str, Any]]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def cluster(fake: FakeKubeApi) -> FakeKubeApi:
    a, d = topo(A100), topo(DGX1)
    fake.add_node(k8s_node("a0", a))
    fake.add_node(k8s_node("a1", a, used=[0, 1, 2]))
    fake.add_node(k8s_node("d0", d, used=[4]))
    fake.add_node(k8s_node("d1", d, used=list(range(8))))
    return fake


@pytest.fixture
def extender(cluster: FakeKubeApi, tmp_path: Path) -> Iterator[ExtenderProcess]:
    ext = ExtenderProcess(cluster.url, tmp_path / "extender.log", WAIT)
    try:
        yield ext
    finally:
        ext.stop(signal.SIGKILL)


def test_answers_are_those_of_one_process(cluster: FakeKubeApi, extender: ExtenderProcess, tmp_path: Path) -> None:
    single = ExtenderProcess(cluster.url, tmp_path / "single.log", WAIT, "--no-answer-process")
    try:
        assert single.answering_pids() == [] and len(extender.answering_pids()) == 1
        pods = [k8s_pod(f"p{n}", n) for n in (1, 2, 3, 4, 8)]
        pods.append(k8s_pod("nv", 2, annotations={f"{PREFIX}/require-nvlink": "true"}))
        pods.append(k8s_pod("none", 0))
        for pod in pods:
            assert filter_out(extender.http, pod) == filter_out(single.http, pod), pod["metadata"]["name"]
            assert scores(extender.http, pod) == scores(single.http, pod), pod["metadata"]["name"]
        assert extender.gauge(LOCAL % "filter") == len(pods) == extender.gauge(LOCAL % "prioritize")
        # NodeLists (not nodeCacheCapable): of known nodes answered from the copy, with an unseen one passed on
        a, d = topo(A100), topo(DGX1)
        known = [node_item("a0", node_annotations(a)), node_item("d0", node_annotations(d, [d.gpus[4].id]))]
        unseen = [*known, node_item("new", node_annotations(a))]
        for items in (known, unseen):
            for verb in ("/filter", "/prioritize"):
                body = list_args(k8s_pod("listed", 2), items)
                assert extender.http.post(verb, json=body).json() == single.http.post(verb, json=body).json()
        assert extender.gauge(LOCAL % "filter") == len(pods) + 1
        text = extender.http.get("/metrics").text  # the answering process's counts reach the one registry
        assert f'gpu_extender_requests_total{{code="200",verb="filter"}} {len(pods) + 2}.0' in text
        assert 'gpu_extender_http_connections{listener="api"} 1.0' in text
    finally:
        single.stop(signal.SIGKILL)


def test_node_changes_and_reservations_reach_the_answers(cluster: FakeKubeApi, extender: ExtenderProcess) -> None:
    pod = k8s_pod("one", 1)
    assert "a0" in filter_out(extender.http, pod)["NodeNames"]
    set_state(cluster, "a0", [g.id for g in topo(A100).gpus])  # the plugin publishes a0 full
    assert eventually(lambda: "a0" in (filter_out(extender.http, pod)["FailedNodes"] or {}), WAIT)
    # a bind (passed on: the state process reserves) holds d0's GPUs for the next filter at once
    big = cluster.add_pod(k8s_pod("big", 4))
    r = extender.http.post("/bind", json=bind_body(big, "d0"))
    assert r.status_code == 200 and r.json()["Error"] == "", r.text
    out = filter_out(extender.http, k8s_pod("next", 4), ["d0"])
    assert "reserved for pods being bound" in out["FailedNodes"]["d0"], out
    assert extender.gauge(LOCAL % "filter") >= 3


def test_what_it_does_not_answer_is_passed_on(extender: ExtenderProcess) -> None:
    job = k8s_pod("w0", 2, annotations={f"{PREFIX}/job": "train", f"{PREFIX}/job-size": "2"})
    out = filter_out(extender.http, job)
    assert out["Error"] == "" and set(out["NodeNames"]) <= set(NAMES)
    unknown = filter_out(extender.http, k8s_pod("lost", 1), ["nowhere"])
    assert "nowhere" in {**(unknown["FailedNodes"] or {}), **(unknown["FailedAndUnresolvableNodes"] or {})}
    bad = extender.http.post("/filter", content=b'{"Pod": 7}')
    assert bad.status_code == 400 and "malformed ExtenderArgs" in bad.json()["Error"]
    assert extender.http.post("/prioritize", content=b"not json").status_code == 400
    assert extender.http.get("/readyz").text == "ok"
    assert extender.http.get("/nowhere").status_code == 404
    assert extender.http.get("/openapi.json").json()["info"]["title"] == "gpu-extender"
    too_big = extender.http.post("/readyz", content=b"x" * (11 << 20), headers={"content-type": "text/plain"})
    assert too_big.status_code == 413
    assert extender.gauge(LOCAL % "filter") == 1  # the unknown node (the copy knows it is unknown); not the job pod


def test_a_killed_answering_process_is_replaced(cluster: FakeKubeApi, extender: ExtenderProcess) -> None:
    held = cluster.add_pod(k8s_pod("held", 2))
    assert extender.http.post("/bind", json=bind_body(held, "a0")).json()["Error"] == ""
    first = extender.answering_pids()[0]
    os.kill(first, signal.SIGKILL)
    assert eventually(lambda: len(extender.answering_pids()) == 2, WAIT), extender.log.read_text()[-2000:]

    def answers() -> bool:
        try:
            return "a0" in filter_out(extender.http, k8s_pod("after", 8), ["a0"])["FailedNodes"]
        except httpx.HTTPError:
            return False

    assert eventually(answers, WAIT)  # a0's reservation, held by the state process, is in the new copy
    assert extender.gauge("gpu_extender_reservations") == 1.0
    assert "extender.front.exited" in extender.log.read_text()


def test_the_answering_process_ends_with_its_state_process(extender: ExtenderProcess) -> None:
    pid = extender.answering_pids()[0]
    extender.proc.send_signal(signal.SIGKILL)
    extender.proc.wait(WAIT)
    assert eventually(lambda: not alive(pid), WAIT)


def test_sigterm_stops_both(extender: ExtenderProcess) -> None:
    pid = extender.answering_pids()[0]
    assert extender.stop() == 0
    assert not alive(pid)
    log = extender.log.read_text()
    assert "extender.front.stopped" in log and "extender.service.stopped" in log


# -- the channel's frames ----------------------------------------------------------------------------------------


def read_from(data: bytes) -> tuple[Any, ...]:
    async def run() -> tuple[Any, ...]:
        a, b = socket.socketpair()
        with a:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            reader, writer = await asyncio.open_unix_connection(sock=b)
            try:
                return await read_message(reader)
            finally:
                writer.close()

    return asyncio.run(run())


def test_frames_round_trip_and_bad_frames_end_the_channel() -> None:
    assert read_from(frame(("states", {"n": None}, {}, None, None))) == ("states", {"n": None}, {}, None, None)
    with pytest.raises(ChannelClosed, match="above"):
        read_from((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ChannelClosed, match="closed"):
        read_from(frame(("ready",))[:-1])
    with pytest.raises(ChannelClosed, match="not a message"):
        read_from(len(pickle.dumps(1)).to_bytes(4, "big") + pickle.dumps(1))


# -- the copy of the node states ---------------------------------------------------------------------------------


def test_the_copy_answers_as_the_cache_and_holds_a_bind_until_released() -> None:
    """The mirror fed the cache's state keys answers filter as the cache itself; a hold (a bind on its way to the
    state process) takes GPUs out until released, whatever the state process says of the node meanwhile."""
    from extender.config import ExtenderConfig
    from extender.front.mirror import MirrorCache
    from extender.placement.engine import Placement
    from extender.state.cache import NodeCache
    from extender.state.pods import Need
    from extender.state.reservations import Reservations

    cache = NodeCache(ExtenderConfig(), Reservations(60.0))
    cache.update_node(k8s_node("d0", topo(DGX1), [0, 1]))
    cache.update_node(k8s_node("a0", topo(A100)))
    mirror = MirrorCache(ExtenderConfig())

    def send() -> None:
        mirror.apply({n: st.key for n, st in cache.states.items()}, dict(cache.topologies), cache.mig_names,
                     cache.shared_names)

    send()
    copy, real = Placement(mirror), Placement(cache)  # type: ignore[arg-type]
    names = ["d0", "a0", "gone"]
    for need in (Need(1), Need(4), Need(6), Need(8)):
        assert copy.filter(names, need) == real.filter(names, need)
        assert copy.score_offer(names, need) == real.score_offer(names, need)
    token = mirror.hold("d0", 0b11111100)  # the six free GPUs
    assert token is not None
    assert "reserved for pods being bound" in copy.filter(["d0"], Need(1)).failed["d0"]
    assert mirror.hold("d0", 0b1) is None  # GPU 0 is not free: nothing held
    assert mirror.hold("d0", 0b100) is None  # GPU 2 is held: not free here either
    mirror.release("d0", token)
    assert copy.filter(["d0"], Need(6)).passed == ["d0"]
    first = mirror.hold("d0", 0b1100)  # two binds on their way to the same node
    second = mirror.hold("d0", 0b110000)
    assert first is not None and second is not None
    assert copy.filter(["d0"], Need(3)).passed == []
    cache.update_node(k8s_node("d0", topo(DGX1), [0, 1, 6]))  # a state sent before either reservation was made
    send()
    assert copy.filter(["d0"], Need(2)).passed == []  # both holds stand: GPU 7 alone is free here
    assert copy.filter(["d0"], Need(1)).passed == ["d0"]
    mirror.release("d0", first)
    mirror.release("d0", first)  # twice: changes nothing
    assert copy.filter(["d0"], Need(3)).passed == ["d0"]  # GPUs 2, 3 and 7
    assert copy.filter(["d0"], Need(4)).passed == []
    mirror.release("d0", second)
    assert copy.filter(names, Need(5)) == real.filter(names, Need(5))
    mirror.apply({"d0": None}, {}, None, None)
    unknown = real.filter(["nowhere"], Need(1)).unresolvable["nowhere"]
    assert copy.filter(["d0"], Need(1)).unresolvable == {"d0": unknown}  # gone from the copy: unknown, as there


def test_relayed_metrics_add_up_to_the_updates_made_here() -> None:
    """Updates in the answering process, drained per series and applied in the state process, leave the one
    registry as the same updates made there directly; an op naming anything else is refused."""
    from prometheus_client import generate_latest

    from extender.front.channel import RelayedMetrics
    from extender.metrics import ExtenderMetrics

    relayed, direct, applied = RelayedMetrics(), ExtenderMetrics(), ExtenderMetrics()
    for target in (relayed, direct):
        for k in range(5):
            target.requests.labels("filter", "200").inc()
            target.latency.labels("filter").observe(0.0003 * (k + 1))
            target.filter_nodes.labels("passed").inc(246)
            target.http_connections.labels("api").inc()
        target.http_connections.labels("api").dec(2)
        target.latency.labels("prioritize").observe(2.5)
    ops: list[tuple[Any, ...]] = []
    relayed.drain(ops)
    assert len(ops) == 6  # one per series and method
    for op in ops:
        RelayedMetrics.apply_op(applied, op)
    def series(m: ExtenderMetrics) -> list[bytes]:  # less the _created timestamps, which differ
        return [line for line in generate_latest(m.registry).splitlines() if b"_created" not in line]

    assert series(applied) == series(direct)
    again: list[tuple[Any, ...]] = []
    relayed.drain(again)
    assert again == []  # drained: nothing twice
    with pytest.raises(ValueError, match="no relayed metric"):
        RelayedMetrics.apply_op(applied, ("metric", "registry", (), "inc", 1.0))
    with pytest.raises(ValueError, match="no relayed metric"):
        RelayedMetrics.apply_op(applied, ("metric", "requests", ("filter", "200"), "__init__", 1.0))
