"""The driver's prepared claims against the ResourceClaims that exist: a claim prepared and then deleted without an
unprepare (a kubelet that lost its checkpoint) is released at start, by the timer, and by a prepare that would
otherwise refuse its GPUs; a claim whose existence cannot be decided is kept, with one warning line."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import structlog

from gpuplugin.dra.driver import ClaimKey
from gpuplugin.dra.reconcile import ClaimReconciler, Reconciler
from gputopo.kube.errors import ApiUnavailable, Forbidden, NotFound, ServerError, Unauthorized
from sim.dra_kubelet import PrepareError
from tests.gpuplugin.dra.conftest import DRIVER, DraNode, make_driver
from tests.helpers.polling import eventually

WAIT = 30.0  # liveness bound on a loaded 2-core machine, never a performance figure


def _state_uids(node: DraNode) -> set[str]:
    return set(json.loads((node.root / "plugin" / "state.json").read_text())["claims"])


def _cdi(node: DraNode, uid: str):
    return node.root / "cdi" / f"{DRIVER}-claim_{uid}.json"


def _singles(node: DraNode) -> list[str]:
    devices = [d for s in sorted(node.slices(), key=lambda s: s["metadata"]["name"])
               for d in s["spec"].get("devices", [])]
    return [d["name"] for d in devices if d["name"].startswith("gpu-")]


@pytest.mark.parametrize("how", ["deleted", "recreated"])
def test_a_claim_gone_while_the_driver_was_down_is_released_at_start(dra_node: DraNode, how: str) -> None:
    gone = dra_node.claim("lost", device="set-4-5-6-7")
    kept = dra_node.claim("alive", device="set-0-1")
    dra_node.kubelet.prepare(DRIVER, [gone, kept])
    dra_node.fake.delete_claim("default", "lost")  # no unprepare: the kubelet forgot it
    if how == "recreated":
        dra_node.claim("lost", device="gpu-2")  # the same name, a new uid, allocated elsewhere
    restarted, _ = make_driver(dra_node.api, dra_node.root)  # the driver's restart: it loads state.json
    assert set(restarted.prepared()) == {gone[1], kept[1]}
    with ClaimReconciler(Reconciler(restarted), interval_s=3600.0):  # its first pass runs at start
        assert eventually(lambda: gone[1] not in restarted.prepared(), WAIT), "the dead claim is still held"
    assert set(restarted.prepared()) == {kept[1]}
    assert _state_uids(dra_node) == {kept[1]}
    assert not _cdi(dra_node, gone[1]).exists() and _cdi(dra_node, kept[1]).exists()
    assert restarted.used_gpus() == {0, 1}


def test_a_claim_deleted_while_the_driver_runs_is_released_by_the_timer(dra_node: DraNode) -> None:
    assert dra_node.settled()
    empty_order = _singles(dra_node)
    lost = dra_node.claim("lost", device="set-4-5-6-7")
    dra_node.kubelet.prepare(DRIVER, [lost])
    assert dra_node.settled()
    assert {int(n[4:]) for n in _singles(dra_node)[-4:]} == {4, 5, 6, 7}  # held GPUs go last
    with ClaimReconciler(Reconciler(dra_node.driver), interval_s=0.2):
        dra_node.fake.delete_claim("default", "lost")
        assert eventually(lambda: dra_node.driver.prepared() == {}, WAIT), "the timer never released the claim"
        assert not _cdi(dra_node, lost[1]).exists() and _state_uids(dra_node) == set()
        assert dra_node.settled()
        assert _singles(dra_node) == empty_order  # the published order has the GPUs back
        again = dra_node.claim("again", device="set-4-5-6-7")
        (device,) = dra_node.kubelet.prepare(DRIVER, [again])[again[1]]
        assert device.device_name == "set-4-5-6-7"


def test_a_prepare_releases_a_holder_that_is_gone_instead_of_refusing(dra_node: DraNode) -> None:
    """No timer needed: the GPUs' holder is looked up when a new claim would clash with it."""
    lost = dra_node.claim("lost", device="set-4-5-6-7")
    dra_node.kubelet.prepare(DRIVER, [lost])
    dra_node.fake.delete_claim("default", "lost")
    new = dra_node.claim("new", device="set-4-7")
    (device,) = dra_node.kubelet.prepare(DRIVER, [new])[new[1]]
    assert device.device_name == "set-4-7"
    assert set(dra_node.driver.prepared()) == {new[1]} and not _cdi(dra_node, lost[1]).exists()


def test_a_prepare_still_refuses_gpus_whose_holder_lives_or_cannot_be_looked_up(dra_node: DraNode) -> None:
    held = dra_node.claim("held", device="set-4-5-6-7")
    dra_node.kubelet.prepare(DRIVER, [held])
    new = dra_node.claim("new", device="set-4-7")
    with pytest.raises(PrepareError, match="refusing to hand a GPU out twice"):
        dra_node.kubelet.prepare(DRIVER, [new])
    dra_node.fake.fail_next(5, status=403, path_regex=r"resourceclaims/held$")
    with pytest.raises(PrepareError, match="refusing to hand a GPU out twice"):
        dra_node.kubelet.prepare(DRIVER, [new])
    assert set(dra_node.driver.prepared()) == {held[1]}


class _Getter:
    """A claim getter that fails as an apiserver does, or answers with claims by name."""

    def __init__(self, fail: Exception | None = None, claims: Mapping[str, Mapping] | None = None) -> None:
        self.fail = fail
        self.claims = dict(claims or {})
        self.calls: list[tuple[str, str]] = []

    def __call__(self, namespace: str, name: str) -> Mapping:
        self.calls.append((namespace, name))
        if self.fail is not None:
            raise self.fail
        if name not in self.claims:
            raise NotFound(404, "NotFound", f'resourceclaims "{name}" not found')
        return self.claims[name]


def _held(node: DraNode, *names: str) -> list[tuple[str, str, str]]:
    claims = [node.claim(n, device=d) for n, d in zip(names, ("set-4-5-6-7", "set-0-1", "gpu-2", "gpu-3"),
                                                         strict=False)]
    node.kubelet.prepare(DRIVER, claims)
    return claims


@pytest.mark.parametrize("error", [
    Forbidden(403, "Forbidden", 'resourceclaims.resource.k8s.io "a" is forbidden'),
    Unauthorized(401, "Unauthorized", "Unauthorized"),
    ApiUnavailable(0, "ConnectionRefused", "connection refused"),
    ServerError(503, "ServiceUnavailable", "etcd leader changed"),
    TimeoutError("read timed out"),
], ids=["403", "401", "unreachable", "503", "timeout"])
def test_a_claim_whose_existence_cannot_be_decided_is_kept_with_one_warning(dra_node: DraNode,
                                                                            error: Exception) -> None:
    claims = _held(dra_node, "a", "b")
    dra_node.driver.get_claim = _Getter(fail=error)
    reconciler = Reconciler(dra_node.driver)
    with structlog.testing.capture_logs() as logs:
        outcome = reconciler.run_once()
    assert outcome.released == () and sorted(outcome.undecided) == sorted(c[1] for c in claims)
    assert set(dra_node.driver.prepared()) == {c[1] for c in claims}
    assert all(_cdi(dra_node, c[1]).exists() for c in claims)
    warnings = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [e["event"] for e in warnings] == ["dra.state.undecided"], warnings  # one line for the pass
    assert str(error) in warnings[0]["error"] and warnings[0]["count"] == 2
    assert dra_node.driver.metrics.undecided._value.get() == 2
    with structlog.testing.capture_logs() as logs:
        reconciler.run_once()  # the outage goes on: no new warning, the gauge tells
    assert not [e for e in logs if e["log_level"] == "warning"]
    dra_node.driver.get_claim = _Getter(claims={c[2]: {"metadata": {"uid": c[1]}} for c in claims})
    assert sorted(reconciler.run_once().alive) == sorted(c[1] for c in claims)
    assert dra_node.driver.metrics.undecided._value.get() == 0


def test_a_live_claim_is_kept_and_only_a_uid_mismatch_or_404_releases(dra_node: DraNode) -> None:
    a, b, c = _held(dra_node, "a", "b", "c")
    dra_node.driver.get_claim = _Getter(claims={
        "a": {"metadata": {"name": "a", "namespace": "default", "uid": a[1]}},
        "b": {"metadata": {"name": "b", "namespace": "default", "uid": "someone-else"}},
    })  # c: 404
    outcome = Reconciler(dra_node.driver).run_once()
    assert sorted(outcome.released) == sorted([b[1], c[1]]) and outcome.alive == (a[1],)
    assert set(dra_node.driver.prepared()) == {a[1]} and _state_uids(dra_node) == {a[1]}
    assert dra_node.driver.used_gpus() == {4, 5, 6, 7}


def test_a_claim_without_a_uid_in_the_answer_is_undecided(dra_node: DraNode) -> None:
    (a,) = _held(dra_node, "a")
    dra_node.driver.get_claim = _Getter(claims={"a": {"metadata": {"name": "a"}}})
    outcome = Reconciler(dra_node.driver).run_once()
    assert outcome.undecided == (a[1],) and set(dra_node.driver.prepared()) == {a[1]}


def test_a_pass_looks_up_a_bounded_number_of_claims_and_the_next_pass_goes_on(dra_node: DraNode) -> None:
    claims = _held(dra_node, "a", "b", "c", "d")
    getter = _Getter()  # every claim is gone
    dra_node.driver.get_claim = getter
    reconciler = Reconciler(dra_node.driver, max_lookups=3)
    first = reconciler.run_once()
    assert len(getter.calls) == 3 and len(first.released) == 3
    second = reconciler.run_once()
    assert len(getter.calls) == 4 and len(second.released) == 1
    assert {*first.released, *second.released} == {c[1] for c in claims}
    assert dra_node.driver.prepared() == {} and _state_uids(dra_node) == set()


def test_a_claim_unprepared_meanwhile_is_not_released_twice(dra_node: DraNode) -> None:
    """The lookup happens outside the driver's lock: a claim the kubelet unprepares in between is simply gone
    from the state when the release comes, and nothing else is touched."""
    a, b = _held(dra_node, "a", "b")

    def getter(namespace: str, name: str) -> Mapping:
        if name == "a":
            dra_node.driver.unprepare([ClaimKey(*a)])  # the kubelet's unprepare, while we looked
        raise NotFound(404, "NotFound", f'resourceclaims "{name}" not found')

    dra_node.driver.get_claim = getter
    unprepares = dra_node.driver.metrics.unprepares.labels(result="ok")._value.get()
    outcome = Reconciler(dra_node.driver).run_once()
    assert outcome.released == (b[1],)
    assert dra_node.driver.prepared() == {}
    assert dra_node.driver.metrics.unprepares.labels(result="ok")._value.get() == unprepares + 1
