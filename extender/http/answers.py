"""How one scheduler-verb request becomes its answer, whatever goes wrong: the error mapping of every verb.

Every verb reads its body itself (size-limited), parses it with extender.wire and answers with orjson bytes, so the
hot path runs no pydantic validation; the pydantic models in extender.http.models only describe the bodies in the
OpenAPI schema. Malformed bodies get 400, oversized ones 413; anything unexpected is logged and answered 200 with
a valid body whose Error says what happened (kube-scheduler treats non-200 as an error anyway, and a verb must never
answer 500).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import structlog
from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

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


class NotHere(Exception):
    """Raised by a verb's `run` in the answering process (extender.front) for a request it leaves to the state
    process: answer() lets it through, and the caller passes the body it kept on."""


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


async def answer(request: Request, verb: str, run: Callable[[Any], Any], ext: Extender,
                 keep: list[bytes] | None = None, then: Callable[[], Awaitable[None]] | None = None) -> Response:
    """Read, decode, run and encode one verb, mapping every failure to a kube-scheduler-shaped answer, and count
    it. `run` takes the decoded body and returns the answer as data, as ready bytes, or (bind) an awaitable.
    `keep` receives the body as read, for a `run` that raises NotHere (nothing is counted then). `then` runs on
    the event loop once a 200 answer has been sent (Verbs.follow_up)."""
    metrics = ext.metrics
    started = time.perf_counter()
    code = 200
    try:
        body = await read_body(request, ext.config.max_body_bytes)
        if keep is not None:
            keep.append(body)
        with _no_cyclic_gc():
            result = run(wire.decode(body))
            del body
            pending = result if isinstance(result, Awaitable) else None
            if pending is None:
                content = result if isinstance(result, bytes) else encode_answer(result)
            del result  # the decoded body and the answer are freed by refcount before the collector is back
        if pending is not None:  # bind (the apiserver), a job pod's filter (its plan): awaited, collector running
            content = encode_answer(await pending)
    except NotHere:
        raise
    except wire.BadRequest as e:
        code = 400
        metrics.bad_requests.labels(verb).inc()
        content = orjson.dumps({"Error": f"malformed {REQUEST_TYPES[verb]}: {e}"})
    except wire.BodyTooLarge as e:
        code = 413
        metrics.bad_requests.labels(verb).inc()
        content = orjson.dumps({"Error": str(e)})
    except Exception as e:
        log.exception("extender.verb.internal_error", verb=verb)
        metrics.internal_errors.labels(verb).inc()
        content = orjson.dumps(error_answer(verb, f"gpu-extender internal error in {verb}: {type(e).__name__}: {e}"))
    metrics.requests.labels(verb, str(code)).inc()
    metrics.latency.labels(verb).observe(time.perf_counter() - started)
    background = BackgroundTask(then) if then is not None and code == 200 else None
    return Response(content, status_code=code, media_type=JSON, background=background)
