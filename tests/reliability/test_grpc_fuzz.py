"""gRPC fuzzing of the real plugin on a unix socket (bounded: a few thousand cases): raw bytes to every method path
and hypothesis-made messages with hostile content. The promises checked are listed in tests/reliability/grpc_fuzz.py;
a kubelet simulator stays registered throughout and must see nothing change.

bench/fuzz_plugin.py runs the same fuzzer at scale and prints its figures.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings

from gpuplugin.proto import deviceplugin_pb2 as pb
from gputopo.discovery.loader import load_topology_file
from tests.gpuplugin.deviceplugin.conftest import DGX1
from tests.reliability import grpc_fuzz as fz
from tests.reliability.conftest import ThreadBaseline
from tests.reliability.strategies import allocate_requests, preferred_requests

HYPOTHESIS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@pytest.fixture(scope="module")
def target() -> Iterator[fz.FuzzTarget]:
    threads = ThreadBaseline()
    with fz.fuzz_target(load_topology_file(DGX1), fz.SESSION) as t:
        yield t
    threads.assert_none_leaked()


def assert_unharmed(t: fz.FuzzTarget) -> None:
    assert t.harm() is None
    assert t.fuzzer.stats.crashes == 0


def test_random_bytes_to_every_method_path(target: fz.FuzzTarget) -> None:
    cases = target.fuzzer.stats.cases
    fz.fuzz_raw(target.fuzzer, random.Random(20240611), cases=4000)
    stats = target.fuzzer.stats
    assert stats.violations == []
    assert stats.crashes == 0
    assert stats.cases - cases == 4000  # no early stop: the server never stopped answering
    seen = set(stats.statuses)
    # Both kinds of body reached every method: some parsed, some did not (grpc.aio says UNKNOWN).
    for m in fz.METHODS:
        assert {code for name, code in seen if name == m.name} >= (
            {"UNIMPLEMENTED"} if m is fz.REGISTER else {"OK", "UNKNOWN"}
        ), m.name
    assert ("Allocate", "INVALID_ARGUMENT") in seen
    assert_unharmed(target)


def test_preferred_allocation_with_hostile_messages(target: fz.FuzzTarget) -> None:
    ids = list(target.topo.ids)

    @HYPOTHESIS
    @given(request=preferred_requests(ids))
    def check(request: pb.PreferredAllocationRequest) -> None:
        count = len(target.fuzzer.stats.violations)
        code = target.fuzzer.send_message(fz.PREFERRED, request)
        assert target.fuzzer.stats.violations[count:] == []
        assert code is grpc.StatusCode.OK or request.ByteSize() > fz.MAX_RECEIVE

    check()
    assert_unharmed(target)


def test_allocate_with_hostile_messages(target: fz.FuzzTarget) -> None:
    ids = list(target.topo.ids)

    @HYPOTHESIS
    @given(request=allocate_requests(ids))
    def check(request: pb.AllocateRequest) -> None:
        count = len(target.fuzzer.stats.violations)
        code = target.fuzzer.send_message(fz.ALLOCATE, request)
        assert target.fuzzer.stats.violations[count:] == []
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) or request.ByteSize() > fz.MAX_RECEIVE

    check()
    assert_unharmed(target)


def test_enormous_requests_are_answered_per_protocol(target: fz.FuzzTarget) -> None:
    """200,000 ids in one request: Allocate refuses with a short message (it once took minutes, quadratic in the
    ids, and echoed every id back past the client's metadata limit); over 4 MiB: RESOURCE_EXHAUSTED."""
    cases = target.fuzzer.stats.cases
    fz.enormous_cases(target.fuzzer)
    stats = target.fuzzer.stats
    assert stats.cases == cases + 4
    assert stats.violations == []  # the oracle: INVALID_ARGUMENT with a short message, OK, RESOURCE_EXHAUSTED
    assert stats.statuses[("Allocate", "RESOURCE_EXHAUSTED")] == 1
    assert_unharmed(target)


def test_a_hostile_request_costs_a_bounded_log_line(target: fz.FuzzTarget) -> None:
    """Every refused or repaired request is logged with what was wrong, but a request of 200,000 ids or of a 100k
    character id must not write megabytes of log (a local client could fill the node's disk)."""
    huge_id = "\u00e9" * 100_000
    with structlog.testing.capture_logs() as logs:
        fz.enormous_cases(target.fuzzer)
        target.fuzzer.send_message(
            fz.PREFERRED,
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[huge_id] * 3 + ["GPU1"],
                        must_include_deviceIDs=[huge_id],
                        allocation_size=1,
                    )
                ]
            ),
            "100k-character ids",
        )
        target.fuzzer.send_message(
            fz.ALLOCATE,
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[huge_id, "GPU1"])]),
            "100k-character id",
        )
    assert target.fuzzer.stats.violations == []
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) >= 5  # each bad request was still logged
    assert max(len(repr(e)) for e in logs) <= 8192, max(logs, key=lambda e: len(repr(e)))["event"]
