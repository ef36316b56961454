"""The list+watch Watcher against the fake apiserver: sync, live events, bookmarks, 410, errors, reconnects."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import orjson
import pytest
import urllib3

from gputopo.kube import KubeArgumentError, Watcher, bind_pod, iter_lines
from tests.gputopo.kube.conftest import Events
from tests.helpers.kube import k8s_node, k8s_pod


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def start_watcher(api, events) -> Iterator:
    started: list[Watcher] = []

    def start(kind: str = "nodes", **kw) -> Watcher:
        kw.setdefault("timeout_seconds", 30)
        kw.setdefault("backoff_initial_s", 0.02)
        kw.setdefault("backoff_max_s", 0.1)
        w = Watcher(api, kind, events, **kw).start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
        assert not w.running


def _watch_requests(fake, kind: str = "nodes"):
    return [r for r in fake.requests if r.path.endswith(f"/{kind}") and r.query.get("watch") == "true"]


def test_initial_sync_then_live_events(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    fake.add_node(k8s_node("b"))
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    (snap,) = events.snapshots()
    assert snap["kind"] == "NodeList"
    assert [i["metadata"]["name"] for i in snap["items"]] == ["a", "b"]
    assert snap["metadata"]["resourceVersion"] == fake.resource_version

    fake.add_node(k8s_node("c"))
    fake.update_node("a", {"metadata": {"annotations": {"x": "1"}}})
    fake.delete_node("b")
    assert events.wait_for(events.has("DELETED", "b"))
    assert [(t, o["metadata"]["name"]) for t, o in events.items[1:]] == [
        ("ADDED", "c"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert events.items[2][1]["metadata"]["annotations"] == {"x": "1"}
    assert w.resource_version == fake.resource_version
    (watch,) = _watch_requests(fake)
    assert watch.query["allowWatchBookmarks"] == "true"
    assert watch.query["resourceVersion"] == snap["metadata"]["resourceVersion"]
    assert watch.query["timeoutSeconds"] == "30"


def test_bookmark_advances_resource_version(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes", deliver_bookmarks=True)
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.add_pod(k8s_pod("unrelated"))  # moves the global resourceVersion; the nodes watch sees only a bookmark
    assert fake.send_bookmarks() == 1
    assert events.wait_for(lambda items: any(t == "BOOKMARK" for t, _ in items))
    bookmark = next(o for t, o in events.items if t == "BOOKMARK")
    assert bookmark["metadata"]["resourceVersion"] == fake.resource_version
    assert w.resource_version == fake.resource_version
    assert w.stats.bookmarks == 1 and w.stats.events == 0


def test_bookmarks_are_not_delivered_by_default(fake, events, start_watcher):
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.send_bookmarks()
    fake.add_node(k8s_node("after"))  # the bookmark is ahead of this event on the stream
    assert events.wait_for(events.has("ADDED", "after"))
    assert [t for t, _ in events.items] == ["SYNC", "ADDED"]
    assert w.stats.bookmarks == 1


def test_initial_list_is_paged_into_one_snapshot(fake, events, start_watcher):
    for i in range(5):
        fake.add_node(k8s_node(f"n{i}"))
    w = start_watcher("nodes", page_limit=2)
    assert w.wait_synced(10)
    assert len(events.snapshots()[0]["items"]) == 5
    assert len([r for r in fake.requests if "limit" in r.query]) == 3


def test_http_410_on_watch_request_relists(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    fake.fail_next(1, status=410, path_regex="watch=true")
    w = start_watcher("nodes")
    assert events.wait_for(lambda items: len([t for t, _ in items if t == "SYNC"]) == 2)
    assert w.stats.relists == 1 and w.stats.errors == 0


def test_watch_410_relists_and_delivers_new_snapshot(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    fake.add_node(k8s_node("b"))
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    # cut the stream and hold the reconnect while the cluster changes and its history is compacted
    gate = fake.hold_next(1, path_regex="watch=true")
    fake.drop_watches()
    assert fake.wait_for_requests(lambda r: r.query.get("watch") == "true", n=2)
    fake.add_node(k8s_node("c"))
    fake.delete_node("a")
    fake.expire_history()
    gate.set()
    assert events.wait_for(lambda items: len([t for t, _ in items if t == "SYNC"]) == 2)
    last = events.snapshots()[-1]
    assert [i["metadata"]["name"] for i in last["items"]] == ["b", "c"]
    assert w.stats.relists == 1
    assert [t for t, _ in events.items] == ["SYNC", "SYNC"]  # no events from the lost window, a snapshot instead
    fake.add_node(k8s_node("d"))
    assert events.wait_for(events.has("ADDED", "d"))
    assert w.resource_version == fake.resource_version


def test_error_event_410_inside_watch_triggers_relist(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    # the exact ERROR line a v1.36 apiserver sent in watch-expired-410.json
    fake.send_raw_watch_line(
        b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        b'"message":"too old resource version: 1 (276)","reason":"Expired","code":410}}')
    assert events.wait_for(lambda items: len([t for t, _ in items if t == "SYNC"]) == 2)
    assert w.stats.relists == 1 and w.stats.errors == 0
    lists = [r for r in fake.requests if r.path == "/api/v1/nodes" and "watch" not in r.query]
    assert len(lists) == 2


def test_other_error_event_reconnects_without_relist(fake, events, start_watcher):
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.send_raw_watch_line(
        b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        b'"message":"Internal error occurred: etcd hiccup","reason":"InternalError","code":500}}')
    fake.add_node(k8s_node("later"))
    assert events.wait_for(events.has("ADDED", "later"))
    assert w.stats.errors == 1 and w.stats.relists == 0 and len(events.snapshots()) == 1


def test_server_errors_then_recovery(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    fake.fail_next(2, status=500, path_regex=r"^/api/v1/nodes\?limit")  # the first lists fail
    fake.fail_next(2, status=503, path_regex="watch=true")  # then the first watches
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.add_node(k8s_node("b"))
    assert events.wait_for(events.has("ADDED", "b"))
    assert w.stats.errors == 4
    assert len(events.snapshots()) == 1
    assert len(_watch_requests(fake)) == 3


def test_dropped_watch_reconnects_from_last_resource_version(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.add_node(k8s_node("b"))
    assert events.wait_for(events.has("ADDED", "b"))
    rv_after_b = fake.resource_version
    assert fake.drop_watches() == 1
    fake.add_node(k8s_node("c"))  # made while (maybe) disconnected: must still arrive, without a relist
    assert events.wait_for(events.has("ADDED", "c"))
    assert len(events.snapshots()) == 1
    assert w.stats.relists == 0
    watches = _watch_requests(fake)
    assert len(watches) == 2
    assert watches[1].query["resourceVersion"] == rv_after_b


def test_watch_timeout_rewatches_from_last_rv(fake, events, start_watcher):
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes", timeout_seconds=1)
    assert w.wait_synced(10)
    assert fake.wait_for_requests(lambda r: r.query.get("watch") == "true", n=2, timeout=10)
    fake.add_node(k8s_node("b"))
    assert events.wait_for(events.has("ADDED", "b"))
    assert len(events.snapshots()) == 1 and w.stats.errors == 0


def test_garbage_lines_are_skipped(fake, events, start_watcher):
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    fake.send_raw_watch_line(b"this is not json")
    fake.send_raw_watch_line(b'{"type":"ADDED"}')
    fake.send_raw_watch_line(b"[1,2]")
    fake.add_node(k8s_node("after-garbage"))
    assert events.wait_for(events.has("ADDED", "after-garbage"))
    assert w.stats.skipped_lines == 3
    assert w.stats.errors == 0 and len(_watch_requests(fake)) == 1


def test_pod_watch_with_field_selector_sees_binding_as_added(fake, api, events, start_watcher):
    fake.add_pod(k8s_pod("mine", node="n1"))
    fake.add_pod(k8s_pod("pending"))
    w = start_watcher("pods", field_selector="spec.nodeName=n1")
    assert w.wait_synced(10)
    assert [i["metadata"]["name"] for i in events.snapshots()[0]["items"]] == ["mine"]
    bind_pod(api, namespace="default", name="pending", uid=None, node="n1",
             annotations={"gpu-topology.io/plan": "{}"})
    assert events.wait_for(events.has("ADDED", "pending"))
    added = next(o for t, o in events.items if t == "ADDED")
    assert added["metadata"]["annotations"]["gpu-topology.io/plan"] == "{}"
    fake.delete_pod("default", "mine")
    assert events.wait_for(events.has("DELETED", "mine"))
    assert w.stats.relists == 0


def test_namespaced_label_selected_pod_watch(fake, events, start_watcher):
    fake.add_pod(k8s_pod("x", namespace="a", labels={"app": "trainer"}))
    fake.add_pod(k8s_pod("y", namespace="b", labels={"app": "trainer"}))
    w = start_watcher("pods", namespace="a", label_selector="app=trainer")
    assert w.wait_synced(10)
    assert [i["metadata"]["name"] for i in events.snapshots()[0]["items"]] == ["x"]
    fake.update_pod("a", "x", {"metadata": {"labels": {"app": "other"}}})  # stops matching -> DELETED
    fake.add_pod(k8s_pod("z", namespace="b", labels={"app": "trainer"}))  # other namespace: not seen
    fake.add_pod(k8s_pod("w", namespace="a", labels={"app": "trainer"}))
    assert events.wait_for(events.has("ADDED", "w"))
    assert [(t, o["metadata"]["name"]) for t, o in events.items[1:]] == [("DELETED", "x"), ("ADDED", "w")]
    assert events.items[1][1]["metadata"]["labels"] == {"app": "trainer"}  # last matching state
    assert fake.requests[0].path == "/api/v1/namespaces/a/pods"


def test_callback_errors_do_not_kill_the_watcher(fake, api):
    seen: list[str] = []
    lock = threading.Condition()

    def flaky(event_type: str, obj: dict) -> None:
        with lock:
            seen.append(event_type)
            lock.notify_all()
        if event_type == "ADDED" and obj["metadata"]["name"] == "boom":
            raise RuntimeError("consumer bug")

    w = Watcher(api, "nodes", flaky, timeout_seconds=30).start()
    try:
        assert w.wait_synced(10)
        fake.add_node(k8s_node("boom"))
        fake.add_node(k8s_node("fine"))
        with lock:
            assert lock.wait_for(lambda: seen.count("ADDED") == 2, 10)
        assert w.stats.callback_errors == 1
    finally:
        w.stop()


def test_stop_interrupts_an_idle_watch_promptly(fake, api, events):
    w = Watcher(api, "nodes", events, timeout_seconds=300).start()
    assert w.wait_synced(10)
    assert fake.wait_for_watches(1)
    w.stop(timeout=5)
    assert not w.running
    assert fake.wait_until(lambda: fake.open_watches() == 0)


def test_wait_synced_is_false_while_the_server_fails(fake, api, events):
    fake.fail_next(1000, status=500)
    w = Watcher(api, "nodes", events, backoff_initial_s=0.01, backoff_max_s=0.02).start()
    try:
        assert not w.wait_synced(0.3)
        assert not w.synced and w.stats.errors >= 1
    finally:
        w.stop()


def test_bad_watcher_arguments(api, events):
    with pytest.raises(KubeArgumentError):
        Watcher(api, "services", events)
    with pytest.raises(KubeArgumentError):
        Watcher(api, "nodes", events, namespace="x")
    with pytest.raises(KubeArgumentError):
        Watcher(api, "pods", events, timeout_seconds=0)


@pytest.mark.parametrize("count", [1, 60])
def test_iter_lines_reads_content_length_and_chunked_bodies(fake, count):
    for i in range(count):
        fake.add_node(k8s_node(f"node-{i:03d}"))
    resp = urllib3.request("GET", f"{fake.url}/api/v1/nodes", preload_content=False)
    assert resp.chunked == (count > 1)  # one small node fits Content-Length, 60 go chunked
    lines = list(iter_lines(resp))
    resp.release_conn()
    assert len(lines) == 1
    assert len(orjson.loads(lines[0])["items"]) == count


def test_wait_delivered_returns_once_a_written_version_is_in_the_callers_view(fake, events, start_watcher):
    """What a new extender leader waits on: its own write, seen through its watch, so every earlier write is too."""
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes")
    assert w.wait_synced(10)
    fake.add_node(k8s_node("b"))
    written = fake.resource_version
    assert w.wait_delivered(written, 10)
    assert events.has("ADDED", "b")(events.items)  # delivered to the callback before the wait returned
    assert not w.wait_delivered(str(int(written) + 1000), 0.2)  # nothing that new was written
    with pytest.raises(KubeArgumentError, match="not a number"):
        w.wait_delivered("not-a-version", 1)


def test_relist_delivers_a_fresh_snapshot_from_an_idle_watch(fake, events, start_watcher):
    """The way to catch up where no own write can be waited on: a full list, taken while the watch sits idle."""
    fake.add_node(k8s_node("a"))
    w = start_watcher("nodes")
    assert w.wait_synced(10) and fake.wait_for_watches(1, 10)
    assert w.relist(10)
    assert len(events.snapshots()) == 2 and w.stats.lists == 2
    assert w.resource_version == fake.resource_version
