"""How one scheduler-verb request becomes its answer, whatever goes wrong: the error mapping of every verb.

Every verb reads its body itself (size-limited), parses it with extender.wire and answers with orjson bytes, so the
hot path runs no pydantic validation; the pydantic models in extender.http.models only describe the bodies in the
OpenAPI schema. Malformed bodies get 400, oversized ones 413; anything unexpected is logged and answered 200 with
a valid body whose Error says what happened (kube-scheduler treats non-200 as an error anyway, and a verb must never
answer 500).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import structlog
from fastapi import Request
from fastapi.responses import Response

from extender import wire
from extender.http.bodies import read_body
from extender.service import Extender
from extender.verbs import filter_result

log = structlog.get_logger(__name__)

JSON = "application/json"
# each verb's path, as the chart's KubeSchedulerConfiguration names them (urlPrefix + verb)
VERB_PATHS = {"/filter": "filter", "/prioritize": "prioritize", "/bind": "bind", "/preempt": "preempt"}
# the kube-scheduler type each verb's body must be, for the 400 answer
REQUEST_TYPES = {"filter": "ExtenderArgs", "prioritize": "ExtenderArgs", "bind": "ExtenderBindingArgs",
                 "preempt": "ExtenderPreemptionArgs"}


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Decoding a big body allocates up to a million acyclic objects: with the cyclic collector on, each batch of
    700 triggers a young collection and the survivors are walked again and again (a 9 MB NodeList took 300 ms to
    decode instead of 60). Nothing a verb builds holds a cycle, so refcounting frees it all; the collector is only
    paused for the synchronous part of one request."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def encode_answer(result: Any) -> bytes:
    """orjson writes at most 255 levels of nesting; filter echoes Node objects, which may be deeper than that."""
    try:
        return orjson.dumps(result)
    except orjson.JSONEncodeError as e:
        raise wire.BadRequest(f"the answer would repeat an object of the request that cannot be written back ({e}: "
                              "nested too deeply)") from None


def error_answer(verb: str, message: str) -> Any:
    """A valid answer of the verb's own type that carries the error (or, where the type has no Error field, says
    nothing: an empty HostPriorityList, no victims)."""
    if verb == "filter":
        return filter_result(None, None, {}, {}, message)
    if verb == "prioritize":
        return []
    if verb == "preempt":
        return {"NodeNameToMetaVictims": None}
    return {"Error": message}


def failure(verb: str, error: Exception, ext: Extender) -> tuple[int, bytes]:
    """The status and body of a verb that failed, counted: 400 malformed, 413 too large, else 200 with the error
    (logged with its traceback: called where it was caught)."""
    metrics = ext.metrics
    if isinstance(error, wire.BadRequest):
        metrics.bad_requests.labels(verb).inc()
        return 400, orjson.dumps({"Error": f"malformed {REQUEST_TYPES[verb]}: {error}"})
    if isinstance(error, wire.BodyTooLarge):
        metrics.bad_requests.labels(verb).inc()
        return 413, orjson.dumps({"Error": str(error)})
    log.exception("extender.verb.internal_error", verb=verb)
    metrics.internal_errors.labels(verb).inc()
    return 200, orjson.dumps(error_answer(verb, f"gpu-extender internal error in {verb}: {type(error).__name__}: "
                                                f"{error}"))


def counted(verb: str, code: int, started: float, ext: Extender) -> None:
    metrics = ext.metrics
    metrics.requests.labels(verb, str(code)).inc()
    metrics.latency.labels(verb).observe(time.perf_counter() - started)


def refusal(ext: Extender) -> str | None:
    """Why this replica must not answer a verb now (None: it may). A view that is not yet whole (a start, a
    restart) lacks bound pods' plans and nodes: a plan from it can give a GPU twice, a refusal from it strands the
    pod. A replica under election answers only while it leads, and only once its view holds what the previous
    leader wrote (extender.leadership)."""
    if ext.leadership is not None:
        return None if ext.leadership.leading else ext.leadership.standby_reason()
    why = ext.not_ready()
    return None if why is None else f"gpu-extender not ready: {why}"


async def refused_answer(request: Request, verb: str, ext: Extender, started: float, why: str) -> Response:
    """503: kube-scheduler takes it as an error of this attempt, and retries the pod after its short back-off
    (1 s at first) instead of parking it as unschedulable. The body is read first (bounded), so the connection stays
    usable for the next request."""
    with contextlib.suppress(Exception):  # too large or cut off: the answer is the same
        await read_body(request, ext.config.max_body_bytes)
    counted(verb, 503, started, ext)
    # a replica handing over closes the connection, so that kube-scheduler's next request finds the new leader
    closing = {"Connection": "close"} if ext.leadership is not None and ext.leadership.handing_over else None
    return Response(orjson.dumps({"Error": why}), status_code=503, media_type=JSON, headers=closing)


async def answer(request: Request, verb: str, run: Callable[[Any], Any], ext: Extender) -> Response:
    """Read, decode, run and encode one verb, mapping every failure to a kube-scheduler-shaped answer, and count
    it. `run` takes the decoded body and returns the answer as data, or (bind, a job pod's filter) an awaitable."""
    started = time.perf_counter()
    code = 200
    if (why := refusal(ext)) is not None and ext.leadership is not None:
        await ext.leadership.settled()  # a takeover catching up, or a handover: bounded
        why = refusal(ext)
    if why is not None:
        return await refused_answer(request, verb, ext, started, why)
    try:
        body = await read_body(request, ext.config.max_body_bytes)
        ext.metrics.request_bytes.labels(verb).observe(len(body))
        with _no_cyclic_gc():
            result = run(wire.decode(body))
            del body
            pending = result if isinstance(result, Awaitable) else None
            if pending is None:
                content = encode_answer(result)
            del result  # the decoded body and the answer are freed by refcount before the collector is back
        if pending is not None:  # bind (the apiserver), a job pod's filter (its plan): awaited, collector running
            content = encode_answer(await pending)
    except Exception as e:
        code, content = failure(verb, e, ext)
    counted(verb, code, started, ext)
    ext.metrics.response_bytes.labels(verb).observe(len(content))
    return Response(content, status_code=code, media_type=JSON)
