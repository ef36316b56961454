"""The device plugin gRPC fuzzer, shared by tests/reliability/test_grpc_fuzz.py and bench/fuzz_plugin.py.

It talks to a real plugin socket the way a hostile or broken client could: raw bytes as request bodies to every
method path (identity serializers, so nothing is checked on our side first), and well-formed messages with any
content. Each answer is checked against what the protocol promises; a broken promise is a `violation`, a server
that stops answering a plain GetDevicePluginOptions is a `crash`.

Promises checked:
- a body that does not parse as the method's request: some RPC status other than OK, and the server lives on;
- a parseable body: GetDevicePluginOptions, PreStartContainer and ListAndWatch (first message) answer OK;
  /v1beta1.Registration/Register is not ours: UNIMPLEMENTED;
- GetPreferredAllocation never answers an RPC error; per container, the answer is distinct ids taken from that
  container's available ids that name our devices, at most `size` of them; for a request the allocator can honour
  (known, distinct ids, must-include inside available, 0 < size <= available, must-include <= size) exactly
  `size` ids including every must-include id;
- Allocate answers OK exactly when every container request names known, healthy, distinct devices (at least
  one), else INVALID_ARGUMENT with a message of bounded size; OK carries one response per container;
- a body over the server's 4 MiB receive limit: RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from gpuplugin.deviceplugin.lifecycle import DEFAULT_RESOURCE_NAME, DEFAULT_SOCKET_NAME, PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.helpers.paths import short_dir

MAX_RECEIVE = 4 * 1024 * 1024  # grpc's default server receive limit; the plugin keeps it
MAX_DETAILS = 4096  # a refusal message must stay readable (and fit any client's metadata limit)
CALL_TIMEOUT = 30.0  # liveness bound per call, not a performance target


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    streaming: bool = False

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


OPTIONS = Method("/v1beta1.DevicePlugin/GetDevicePluginOptions", pb.Empty)
LIST_AND_WATCH = Method("/v1beta1.DevicePlugin/ListAndWatch", pb.Empty, streaming=True)
PREFERRED = Method("/v1beta1.DevicePlugin/GetPreferredAllocation", pb.PreferredAllocationRequest)
ALLOCATE = Method("/v1beta1.DevicePlugin/Allocate", pb.AllocateRequest)
PRESTART = Method("/v1beta1.DevicePlugin/PreStartContainer", pb.PreStartContainerRequest)
REGISTER = Method("/v1beta1.Registration/Register", pb.RegisterRequest)
METHODS: tuple[Method, ...] = (OPTIONS, LIST_AND_WATCH, PREFERRED, ALLOCATE, PRESTART, REGISTER)


def _identity(b: bytes) -> bytes:
    return b


def parse(method: Method, body: bytes) -> Message | None:
    try:
        return method.request.FromString(body)
    except (DecodeError, RuntimeError, ValueError):
        return None


@dataclass
class FuzzStats:
    """What a fuzz run saw: cases, status counts per method, broken promises, crashes, the slowest call."""

    cases: int = 0
    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    crashes: int = 0
    slowest_s: float = 0.0
    slowest_case: str = ""
    seconds: dict[str, list[float]] = field(default_factory=dict)  # per method, every call

    def add(self, method: Method, code: grpc.StatusCode, seconds: float, what: str) -> None:
        self.cases += 1
        self.statuses[(method.name, code.name)] += 1
        self.seconds.setdefault(method.name, []).append(seconds)
        if seconds > self.slowest_s:
            self.slowest_s, self.slowest_case = seconds, f"{method.name}: {what}"

    def merge(self, other: FuzzStats) -> None:
        self.cases += other.cases
        self.statuses.update(other.statuses)
        self.violations += other.violations
        self.crashes += other.crashes
        for name, values in other.seconds.items():
            self.seconds.setdefault(name, []).extend(values)
        if other.slowest_s > self.slowest_s:
            self.slowest_s, self.slowest_case = other.slowest_s, other.slowest_case


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class PluginFuzzer:
    """Sends cases to the plugin on `socket_path`; `manager` is the plugin's ResourceManager (the oracle reads its
    device ids and health). Not thread-safe: one fuzzer per thread."""

    def __init__(self, socket_path: Path, manager: ResourceManager, stats: FuzzStats | None = None) -> None:
        self.manager = manager
        self.known = frozenset(d.id for d in manager.devices)
        self.stats = stats if stats is not None else FuzzStats()
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._unary: dict[str, Callable[..., bytes]] = {}
        self._stream: dict[str, Callable[..., Any]] = {}
        for m in METHODS:
            if m.streaming:
                self._stream[m.path] = self._channel.unary_stream(
                    m.path, request_serializer=_identity, response_deserializer=_identity
                )
            else:
                self._unary[m.path] = self._channel.unary_unary(
                    m.path, request_serializer=_identity, response_deserializer=_identity
                )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PluginFuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sending ----

    def _call(self, method: Method, body: bytes) -> tuple[grpc.StatusCode, bytes, str, float]:
        start = time.perf_counter()
        reply, details = b"", ""
        try:
            if method.streaming:
                call = self._stream[method.path](body, timeout=CALL_TIMEOUT)
                try:
                    reply = next(call)
                    code = grpc.StatusCode.OK
                except StopIteration:
                    code = grpc.StatusCode.OK
                finally:
                    call.cancel()
            else:
                reply = self._unary[method.path](body, timeout=CALL_TIMEOUT)
                code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        return code, reply, details, time.perf_counter() - start

    def send(self, method: Method, body: bytes, what: str = "") -> grpc.StatusCode:
        """One case: `body` as is to `method`; the answer is checked against the promises above."""
        code, reply, details, seconds = self._call(method, body)
        label = what or f"{len(body)} bytes"
        self.stats.add(method, code, seconds, label)
        request = parse(method, body)
        problem = self._judge(method, body, request, code, reply, details)
        if problem:
            self.stats.violations.append(f"{method.name} [{label}] {_short(body, 120)}: {problem}")
        return code

    def send_message(self, method: Method, message: Message, what: str = "") -> grpc.StatusCode:
        return self.send(method, message.SerializeToString(), what or type(message).__name__)

    def alive(self) -> bool:
        """A normal call still answers; counts a crash when it does not."""
        code, reply, _, _ = self._call(OPTIONS, b"")
        ok = code is grpc.StatusCode.OK and pb.DevicePluginOptions.FromString(reply).get_preferred_allocation_available
        if not ok:
            self.stats.crashes += 1
        return ok

    # ---- the oracle ----

    def _judge(
        self, method: Method, body: bytes, request: Message | None, code: grpc.StatusCode, reply: bytes, details: str
    ) -> str | None:
        if len(body) > MAX_RECEIVE:
            return None if code is grpc.StatusCode.RESOURCE_EXHAUSTED else f"oversized body answered {code.name}"
        if request is None:
            return "unparseable body answered OK" if code is grpc.StatusCode.OK else None
        if method is REGISTER:
            return None if code is grpc.StatusCode.UNIMPLEMENTED else f"Register on the plugin answered {code.name}"
        if method is PREFERRED:
            assert isinstance(request, pb.PreferredAllocationRequest)
            return self._judge_preferred(request, code, reply, details)
        if method is ALLOCATE:
            assert isinstance(request, pb.AllocateRequest)
            return self._judge_allocate(request, code, reply, details)
        if code is not grpc.StatusCode.OK:
            return f"answered {code.name}: {_short(details)}"
        if method is LIST_AND_WATCH:
            listed = {d.ID for d in pb.ListAndWatchResponse.FromString(reply).devices}
            return None if listed == self.known else f"first list names {sorted(listed)}"
        return None

    def _judge_preferred(
        self, req: pb.PreferredAllocationRequest, code: grpc.StatusCode, reply: bytes, details: str
    ) -> str | None:
        if code is not grpc.StatusCode.OK:
            return f"RPC error {code.name}: {_short(details)}"
        resp = pb.PreferredAllocationResponse.FromString(reply)
        if len(resp.container_responses) != len(req.container_requests):
            return f"{len(resp.container_responses)} answers for {len(req.container_requests)} container requests"
        for k, (creq, cresp) in enumerate(zip(req.container_requests, resp.container_responses, strict=True)):
            ids = list(cresp.deviceIDs)
            available = set(creq.available_deviceIDs)
            if len(set(ids)) != len(ids):
                return f"container {k}: repeated ids {ids}"
            if not set(ids) <= available & self.known:
                return f"container {k}: {sorted(set(ids) - (available & self.known))} not ours or not available"
            if len(ids) > max(creq.allocation_size, 0):
                return f"container {k}: {len(ids)} ids for size {creq.allocation_size}"
            exact = len(ids) == creq.allocation_size and set(creq.must_include_deviceIDs) <= set(ids)
            if honourable(creq, self.known) and not exact:
                return f"container {k}: valid request answered {ids}"
        return None

    def _judge_allocate(self, req: pb.AllocateRequest, code: grpc.StatusCode, reply: bytes, details: str) -> str | None:
        healthy = set(self.manager.healthy_ids())
        valid = all(
            c.devices_ids and len(set(c.devices_ids)) == len(c.devices_ids) and set(c.devices_ids) <= healthy
            for c in req.container_requests
        )
        if code is grpc.StatusCode.OK:
            if not valid:
                return "invalid request answered OK"
            resp = pb.AllocateResponse.FromString(reply)
            if len(resp.container_responses) != len(req.container_requests):
                return f"{len(resp.container_responses)} answers for {len(req.container_requests)} containers"
            return None
        if code is not grpc.StatusCode.INVALID_ARGUMENT:
            return f"answered {code.name}: {_short(details)}"
        if valid:
            return f"valid request refused: {_short(details)}"
        if len(details.encode()) > MAX_DETAILS:
            return f"refusal message of {len(details.encode())} bytes"
        return None


def honourable(creq: pb.ContainerPreferredAllocationRequest, known: frozenset[str]) -> bool:
    """Whether a container request is one the allocator must answer exactly (see the module docstring)."""
    available, must = list(creq.available_deviceIDs), list(creq.must_include_deviceIDs)
    size = creq.allocation_size
    return (
        set(available) <= known
        and len(set(available)) == len(available)
        and len(set(must)) == len(must)
        and set(must) <= set(available)
        and 0 < size <= len(available)
        and len(must) <= size
    )


# ---- raw bytes ----------------------------------------------------------------------------------------------------


def valid_body(method: Method, rng: random.Random, known: Sequence[str]) -> bytes:
    """A well-formed request of `method` with plausible content, to mutate."""
    ids = list(known)

    def pick() -> list[str]:
        return rng.sample(ids, rng.randint(0, len(ids)))

    if method is PREFERRED:
        msg: Message = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=pick(), must_include_deviceIDs=pick()[:2], allocation_size=rng.randint(-2, 9)
                )
                for _ in range(rng.randint(0, 3))
            ]
        )
    elif method is ALLOCATE:
        msg = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=pick()) for _ in range(rng.randint(0, 3))]
        )
    elif method is PRESTART:
        msg = pb.PreStartContainerRequest(devices_ids=pick())
    elif method is REGISTER:
        msg = pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="example.com/gpu")
    else:
        msg = pb.Empty()
    return msg.SerializeToString()


def mutate(body: bytes, rng: random.Random) -> bytes:
    """Flip, insert, delete, duplicate or truncate bytes of `body`."""
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randint(0, len(data))
        if op == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and data:
            del data[pos : pos + rng.randint(1, 8)]
        elif op == 3 and data:
            data += data[pos : pos + rng.randint(1, 32)]
        else:
            data = data[:pos]
    return bytes(data)


def random_body(method: Method, rng: random.Random, known: Sequence[str]) -> tuple[bytes, str]:
    """A raw body: pure noise, a mutated valid request, or a valid request with noise appended."""
    kind = rng.randrange(4)
    if kind == 0:
        n = rng.choice((0, 1, 2, 3, 5, 8, 16, 64, 256)) if rng.random() < 0.9 else rng.randint(1000, 20000)
        return rng.randbytes(n), "noise"
    if kind == 3:
        return valid_body(method, rng, known) + rng.randbytes(rng.randint(1, 16)), "valid+noise"
    return mutate(valid_body(method, rng, known), rng), "mutated"


def fuzz_raw(fuzzer: PluginFuzzer, rng: random.Random, cases: int, check_every: int = 250) -> None:
    """`cases` raw-byte cases spread over every method path; a liveness check every `check_every` cases."""
    known = sorted(fuzzer.known)
    for n in range(cases):
        method = METHODS[rng.randrange(len(METHODS))]
        body, what = random_body(method, rng, known)
        fuzzer.send(method, body, what)
        if (n + 1) % check_every == 0 and not fuzzer.alive():
            return
    fuzzer.alive()


# ---- a plugin to fuzz ----------------------------------------------------------------------------------------------

RESOURCE = DEFAULT_RESOURCE_NAME
LIVENESS_S = 15.0


@dataclass
class FuzzTarget:
    """The real plugin serving `topo` (one GPU unhealthy), registered with a kubelet simulator, and a fuzzer on it."""

    topo: Topology
    manager: ResourceManager
    sim: KubeletSimulator
    fuzzer: PluginFuzzer
    sick: str
    updates: int  # ListAndWatch messages the kubelet had before fuzzing

    def harm(self) -> str | None:
        """What the fuzzing broke, if anything: the plugin must answer, the kubelet's stream must not have been
        disturbed (no extra list, same health), and admission must still work."""
        if not self.fuzzer.alive():
            return "the plugin stopped answering GetDevicePluginOptions"
        if self.sim.updates(RESOURCE) != self.updates:
            return f"the kubelet got {self.sim.updates(RESOURCE) - self.updates} unexpected ListAndWatch messages"
        devices = self.sim.devices(RESOURCE)
        if len(devices) != self.topo.size or [d.id for d in devices if not d.healthy] != [self.sick]:
            return f"the kubelet now lists {devices}"
        free = [d.id for d in devices if d.healthy]
        ids = self.sim.preferred(RESOURCE, free, [], 4)
        answer = self.sim.allocate(RESOURCE, ids)
        if len(ids) != 4 or len(answer.annotations) < 2:
            return f"admission of 4 GPUs went wrong: {ids}"
        return None


@contextmanager
def fuzz_target(topo: Topology, stats: FuzzStats, *, id_strategy: str = "uuid", sick: int = 5) -> Iterator[FuzzTarget]:
    manager = ResourceManager(topo, id_strategy=id_strategy)
    sick_id = manager.devices[sick].id
    manager.set_health([sick_id], healthy=False)
    with short_dir("fuzz-") as plugin_dir:
        sim = KubeletSimulator(plugin_dir).start()
        runner = PluginRunner(manager, plugin_dir, backoff_initial=0.05, backoff_max=0.5).start()
        try:
            sim.wait_for_devices(RESOURCE, topo.size - 1, LIVENESS_S)
            with PluginFuzzer(plugin_dir / DEFAULT_SOCKET_NAME, manager, stats) as fuzzer:
                yield FuzzTarget(topo, manager, sim, fuzzer, sick_id, sim.updates(RESOURCE))
        finally:
            runner.stop()
            sim.stop()


def enormous_cases(fuzzer: PluginFuzzer) -> None:
    """Requests far beyond anything a kubelet sends: 200,000 ids (1.6 MB), one id repeated 200,000 times, a
    preference among 200,000 unknown ids, and a body over the 4 MiB receive limit."""
    ours = sorted(fuzzer.known)
    many = [f"id-{i}" for i in range(200_000)]
    fuzzer.send_message(
        ALLOCATE, pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=many)]),
        "200k unknown ids",
    )
    fuzzer.send_message(
        ALLOCATE,
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[ours[1]] * 200_000)]),
        "one id 200k times",
    )
    fuzzer.send_message(
        PREFERRED,
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[*many, ours[0], ours[3]], must_include_deviceIDs=many[:1000], allocation_size=2
                )
            ]
        ),
        "200k unknown available ids",
    )
    fuzzer.send_message(
        ALLOCATE,
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x" * (5 << 20)])]),
        "5 MiB id",
    )


# Every fuzzer of a test session adds to this, so the terminal summary can say how many cases ran.
SESSION = FuzzStats()


def summary(stats: FuzzStats) -> str:
    per_method = Counter[str]()
    for (method, _), n in stats.statuses.items():
        per_method[method] += n
    methods = ", ".join(f"{m} {n}" for m, n in sorted(per_method.items()))
    return (
        f"gRPC fuzz: {stats.cases} cases ({methods}); {len(stats.violations)} violations, {stats.crashes} crashes; "
        f"slowest call {stats.slowest_s * 1000:.1f} ms ({stats.slowest_case})"
    )
