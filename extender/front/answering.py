"""The answering process (`python -m extender.front`, started by extender.front.link): serves the API port and
answers the common filter and prioritize itself, from the node states the state process streams to it.

A request is answered here when it is filter or prioritize, the state process has said the cache is synced, the
pod asks whole GPUs of the configured resource and belongs to no job, the body names nodes the cache knows
(NodeNames, or a NodeList of known nodes), and no node serves that resource as MIG instances or replicas: then
extender.verbs answers it over extender.placement.engine, the same code as in the state process, on the mirror
(extender.front.mirror).
Everything else (bind, preempt, job pods, MIG, shared GPUs, NodeLists with unseen nodes, the filter of a preemptor
back at its nominated node, probes, metrics, the inventory and the docs) is passed to the state process whole and
its answer relayed. A preemptor's victims must be seen gone the moment kube-scheduler retries it: the state process
hears of them first, and can ask the apiserver (extender.verbs).

What a local answer leaves behind for the state process (the pod's needs and offer, which bind reads; its metrics)
is sent ahead of the next passed-on request on the same ordered channel, so a bind never arrives before them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import orjson
import structlog
import uvloop
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from extender import wire
from extender.config import ExtenderConfig
from extender.front.channel import ChannelClosed, RelayedMetrics, frame, read_first, read_message
from extender.front.mirror import MirrorCache
from extender.front.spawn import receive_listener
from extender.http.answers import VERB_PATHS, NotHere, answer, counted, failure, settle
from extender.http.bodies import BodyTooLarge, read_body
from extender.http.server import api_server_config, companion_server
from extender.jobs.membership import MembershipError, job_membership
from extender.logs import configure_logging
from extender.placement.engine import WHOLE, Placement
from extender.placement.explain import Offer
from extender.state.pods import PodNeeds, PodSpecError, RecentPods, nominated_node, pod_needs
from extender.verbs import Verbs
from gputopo.core.bitset import mask_of

log = structlog.get_logger(__name__)

LOCAL_VERBS = {path: verb for path, verb in VERB_PATHS.items() if verb in ("filter", "prioritize")}
BIND_PATH = next(path for path, verb in VERB_PATHS.items() if verb == "bind")
UNANSWERED = orjson.dumps({"Error": "gpu-extender's state process is not answering"})
CALL_TIMEOUT_S = 120.0  # a passed-on bind waits for the apiserver: well above its own request timeout
RECENT_NEEDS = 10_000  # pods answered here whose needs a bind may look up
FLUSH_INTERVAL_S = 0.5  # metrics of local answers and of connections reach the state process at least this often
PASS_ON = "gpu_extender.pass_on"  # set in a request's scope by FrontLane: not answered here, FrontApp passes it on
SCOPE_FIELDS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
                "headers", "client", "server")


class _TellingRecent(RecentPods):
    """RecentPods as the verbs see it: what bind will read goes to the state process's own, and stays here too,
    for the hold a bind of the pod takes on its node (Front.hold_for_bind)."""

    def __init__(self, ops: list[tuple[Any, ...]]) -> None:
        super().__init__(RECENT_NEEDS)
        self._ops = ops

    def remember(self, needs: PodNeeds) -> None:
        if needs.uid:
            self._ops.append(("recent", needs))
        super().remember(needs)


class _TellingExplainer:
    def __init__(self, ops: list[tuple[Any, ...]]) -> None:
        self._ops = ops

    def remember(self, uid: str, found: Offer | None) -> None:
        if uid:
            self._ops.append(("offer", uid, found))


class _NoJobs:
    """Front.local answers pods of no job only."""

    def pod_of(self, pod: Any, needs: PodNeeds) -> None:
        return None


class Front:
    """What extender.verbs reads of an Extender, in the answering process; `local` decides what is answered here."""

    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        self.ops: list[tuple[Any, ...]] = []
        self.cache = MirrorCache(config)
        self.placement = Placement(self.cache)  # type: ignore[arg-type]  # the mirror has what the verbs read
        self.metrics = RelayedMetrics()
        self.recent = _TellingRecent(self.ops)
        self.explainer = _TellingExplainer(self.ops)
        self.jobs = _NoJobs()
        self.sync = None  # no apiserver here: a filter that would ask it is passed on (`local`)
        self.verbs = Verbs(self)  # type: ignore[arg-type]
        self.ready = False
        self.leading = False  # as the state process says: under leader election a standby answers nothing here
        self.leadership = None  # the Lease is the state process's (extender.http.answers reads this)
        self._needs_args = (config.resource_name, config.keys)

    def local(self, verb: str, data: Any) -> Any:
        """The verb's answer, or NotHere. A malformed body is not here either: the state process words and counts
        the 400, as it does for every other request."""
        if not (self.ready and self.leading):
            raise NotHere
        try:
            args = wire.extender_args(data)
        except wire.BadRequest:
            raise NotHere from None
        if args.items is not None and not all(map(self.cache.states.__contains__, args.names)):
            raise NotHere  # a NodeList naming a node the cache has not seen: the state process reads its object
        try:
            needs = pod_needs(args.pod, *self._needs_args, self.cache.shared_names)
            if needs.need.resource is not None or job_membership(args.pod, self.config.keys) is not None:
                raise NotHere
        except (PodSpecError, MembershipError):
            raise NotHere from None
        if self.placement.route(needs.need)[0] != WHOLE:
            raise NotHere
        if verb == "filter" and nominated_node(args.pod) in args.names:
            raise NotHere  # a preemptor back at its node: the state process checks its victims are gone (verbs)
        if verb == "filter":
            return self.verbs.filter_pod(args, needs)
        return self.verbs.prioritize_pod(args, needs)

    def shortcut(self, verb: str) -> Callable[[bytes], bytes | None] | None:
        """What the verb tries on its body before decoding it (answers' `shortcut`), as Verbs.shortcut."""
        return self.local_repeated if verb == "prioritize" else None

    def local_repeated(self, body: bytes) -> bytes | None:
        """prioritize's answer for a body that repeats the filter answered here (Verbs.repeated), under the gates
        of `local` that may have moved since: readiness, and how the nodes serve the resource."""
        found = self.verbs.repeated(body)
        if found is None:
            return None
        if not (self.ready and self.leading) or self.placement.route(found[1].need)[0] != WHOLE:
            raise NotHere
        return self.verbs.prioritize_pod(*found)

    def hold_for_bind(self, body: bytes) -> tuple[str, int] | None:
        """Before a bind goes to the state process: the GPUs it will most likely choose (the same allocator on the
        same state, as extender.binder does) held on the node here until its answer, so the next pod's filter does
        not offer them meanwhile. Only for pods answered here; anything unexpected holds nothing (the state
        process decides, and says so)."""
        try:
            req = wire.binding_args(orjson.loads(body))
        except (orjson.JSONDecodeError, wire.BadRequest):
            return None
        known = self.recent.get(req.uid) if req.uid else None
        need = known.need if known is not None else None
        st = self.cache.states.get(req.node)
        if need is None or need.size == 0 or st is None or st.problem is not None or st.free.bit_count() < need.size:
            return None
        topo = self.cache.topologies.get(st.fingerprint)
        if topo is None:
            return None
        fit = self.placement.memo.known_fit(topo, st.free, need)  # prioritize worked it out: never a new search
        alloc = fit.alloc if fit is not None else None
        if alloc is None:
            return None
        token = self.cache.hold(req.node, mask_of(alloc.gpus))
        return (req.node, token) if token is not None else None


class FrontLane:
    """filter and prioritize answered in the HTTP protocol itself (extender.http.server's lane): the same answer
    FrontApp gives through extender.http.answers, without uvicorn's request cycle and the ASGI messages. A request
    not answered here is marked PASS_ON for FrontApp, which passes it on without asking `local` again. Binds are
    passed on from here too (Link.relay_bind), without the request cycle either."""

    def __init__(self, front: Front, link: Link) -> None:
        self.front = front
        self.link = link

    def claims(self, scope: dict[str, Any]) -> bool:
        return scope["method"] == "POST" and (scope["path"] in LOCAL_VERBS or scope["path"] == BIND_PATH)

    def __call__(self, scope: dict[str, Any], body: bytes) -> tuple[int, bytes, Any] | Awaitable[Any] | None:
        front = self.front
        if scope["path"] == BIND_PATH:
            return self.link.relay_bind(scope, body)
        verb = LOCAL_VERBS[scope["path"]]
        started = time.perf_counter()
        try:
            settled = settle(verb, body, partial(front.local, verb), front.shortcut(verb))
            if not isinstance(settled, bytes):  # `local` answers at once or not at all
                raise TypeError(f"{verb} answered here returned {type(settled).__name__}, not its answer")
            code, content = 200, settled
        except NotHere:
            scope[PASS_ON] = True
            return None
        except Exception as e:
            code, content = failure(verb, e, front)  # type: ignore[arg-type]
        counted(verb, code, started, front)  # type: ignore[arg-type]
        if code != 200:
            return code, content, None
        front.metrics.answered_apart.labels(verb).inc()
        return code, content, front.verbs.prepare_prioritize_now if verb == "filter" else None


class Link:
    """The answering process's end of the channel: states in, passed-on requests out and their replies back."""

    def __init__(self, front: Front, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.front = front
        self._reader, self._writer = reader, writer
        self._calls: dict[int, asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]]] = {}
        self._next = 0
        self.closed: str | None = None

    async def run(self) -> None:
        """Until the state process goes away (then this process has nothing to answer with, and ends)."""
        flusher = asyncio.create_task(self._flush_every())
        try:
            while True:
                message = await read_message(self._reader)
                kind = message[0]
                if kind == "states":
                    self.front.cache.apply(*message[1:5])
                elif kind == "reply":
                    fut = self._calls.pop(message[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result((message[2], message[3], message[4]))
                elif kind == "leading":
                    if self.front.leading != bool(message[1]):
                        log.info("extender.front.leading", leading=bool(message[1]))
                    self.front.leading = bool(message[1])
                elif kind == "ready":
                    if not self.front.ready:
                        log.info("extender.front.ready", nodes=len(self.front.cache.states))
                    self.front.ready = True
                else:
                    log.warning("extender.front.unknown_message", kind=kind)
        except ChannelClosed as e:
            self.closed = str(e)
        finally:
            flusher.cancel()
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(ChannelClosed(self.closed or "channel closed"))
            self._calls.clear()

    def flush(self, then: bytes = b"") -> None:
        """Send what local answers told, with `then` (a frame) behind it in the same write. Before each passed-on
        request, and every FLUSH_INTERVAL_S for the metrics: not after each answer, which would wake the state
        process twice per pod for nothing urgent."""
        if self.closed is not None:
            return
        self.front.metrics.drain(self.front.ops)
        if self.front.ops:
            ops = self.front.ops[:]
            self.front.ops.clear()
            then = frame(("told", ops)) + then
        if then:
            self._writer.write(then)

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()

    async def relay_bind(self, scope: dict[str, Any], body: bytes) -> tuple[int, bytes, None]:
        """A bind passed on to the state process (which reserves and binds), the GPUs it will most likely take held
        here meanwhile (Front.hold_for_bind); its answer is JSON, whatever it says."""
        front = self.front
        held = front.hold_for_bind(body)
        try:
            status, _, content = await self.call(scope, body)
        except (ChannelClosed, TimeoutError, OSError) as e:
            log.warning("extender.front.pass_on_failed", path=scope.get("path"), error=f"{type(e).__name__}: {e}")
            return 503, UNANSWERED, None
        finally:
            if held is not None:
                front.cache.release(*held)
        return status, content, None

    async def call(self, scope: Scope, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        if self.closed is not None:
            raise ChannelClosed(self.closed)
        self._next += 1
        call_id = self._next
        fut: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        plain = {k: scope[k] for k in SCOPE_FIELDS if k in scope}
        plain["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
        self.flush(frame(("call", call_id, plain, body)))  # what earlier local answers told goes first
        try:
            await self._writer.drain()
            return await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)


class FrontApp:
    """The ASGI app of the answering process."""

    def __init__(self, front: Front, link: Link) -> None:
        self.front = front
        self.link = link

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        # a verb FrontLane found is not for here is passed on as any other request (requests the lane did not
        # take, such as one that waits for a 100 Continue, are answered here the same way as in the lane)
        verb = LOCAL_VERBS.get(scope["path"]) if scope["method"] == "POST" and PASS_ON not in scope else None
        if verb is not None:
            kept: list[bytes] = []
            try:
                response = await answer(Request(scope, receive), verb, partial(self.front.local, verb), self.front,
                                        kept, self.front.verbs.follow_up(verb),  # type: ignore[arg-type]
                                        self.front.shortcut(verb))
            except NotHere:
                await self._pass_on(scope, kept[0], send)
                return
            if response.status_code == 200:
                self.front.metrics.answered_apart.labels(verb).inc()
            await response(scope, receive, send)  # what it told waits for the next passed-on request (a bind)
            return
        try:
            body = await read_body(Request(scope, receive), self.front.config.max_body_bytes)
        except BodyTooLarge as e:
            await _send(send, 413, orjson.dumps({"Error": str(e)}))
            return
        except wire.BadRequest as e:
            await _send(send, 400, orjson.dumps({"Error": str(e)}))
            return
        if scope["path"] == "/readyz" and not self.front.ready:  # ready once this process can answer too
            await _send(send, 503, b"answering process has no node states yet", b"text/plain")
            return
        if scope["method"] == "POST" and scope["path"] == BIND_PATH:  # one the lane did not take (100-continue)
            status, content, _ = await self.link.relay_bind(scope, body)
            await _send(send, status, content)
            return
        await self._pass_on(scope, body, send)

    async def _pass_on(self, scope: Scope, body: bytes, send: Send) -> None:
        try:
            status, headers, content = await self.link.call(scope, body)
        except (ChannelClosed, TimeoutError, OSError) as e:
            log.warning("extender.front.pass_on_failed", path=scope.get("path"), error=f"{type(e).__name__}: {e}")
            await _send(send, 503, UNANSWERED)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def _send(send: Send, status: int, content: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content})


def serve(config: ExtenderConfig, listen: socket.socket, channel: socket.socket) -> None:
    front = Front(config)

    async def run() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=channel)
        link = Link(front, reader, writer)
        # signals are this process's own (uvicorn's re-raise after its shutdown would end it before its last line)
        server = companion_server(api_server_config(FrontApp(front, link), config, front.metrics,  # type: ignore[arg-type]
                                                    lane=FrontLane(front, link)))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, setattr, server, "should_exit", True)

        async def follow() -> None:
            await link.run()
            if not server.should_exit:
                log.warning("extender.front.state_process_gone", why=link.closed)
                server.should_exit = True

        following = asyncio.create_task(follow())
        gc.collect()
        gc.freeze()
        try:
            await server.serve(sockets=[listen])
        finally:
            following.cancel()
            writer.close()

    sys.setswitchinterval(0.0005)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the loop server_config names
        runner.run(run())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m extender.front",
                                     description="gpu-extender's answering process (started by gpu-extender serve)")
    parser.add_argument("--channel-fd", type=int, required=True, help="the state process's socket pair end")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=args.channel_fd)
    try:
        listen = receive_listener(channel)
    except EOFError:
        return  # started early by a `serve` that then could not serve: nothing to say, its error is said there
    first = read_first(channel)
    if first[0] != "config" or not isinstance(first[1], ExtenderConfig):
        raise SystemExit(f"the first message must be the config, got {first[0]!r}")
    config: ExtenderConfig = first[1]
    configure_logging(config.log_level)
    log.info("extender.front.start", port=listen.getsockname()[1] if listen.family != socket.AF_UNIX else None)
    serve(config, listen, channel)
    log.info("extender.front.stopped")
