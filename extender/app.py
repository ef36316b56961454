"""The HTTP face of the extender: kube-scheduler's verbs, health, readiness, metrics, and the standalone inventory.

Every verb reads its body itself (size-limited), parses it with extender.wire and answers with orjson bytes, so the
hot path runs no pydantic validation; the pydantic models in extender.models only describe the bodies in the
OpenAPI schema. Malformed bodies get 400, oversized ones 413; anything unexpected is logged and answered 200 with
a valid body whose Error says what happened (kube-scheduler treats non-200 as an error anyway, and a verb must never
answer 500).
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from itertools import chain, repeat
from typing import Any

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from extender import models, wire
from extender.pods import PodSpecError, pod_needs
from extender.preempt import NodeVictims, keep_victims
from extender.service import Extender

log = structlog.get_logger(__name__)

JSON = "application/json"
_BODY = {"filter": "ExtenderArgs", "prioritize": "ExtenderArgs", "bind": "ExtenderBindingArgs",
         "preempt": "ExtenderPreemptionArgs"}
_ERRORS = {400: {"model": models.ErrorBody, "description": "Malformed body (not JSON, or not this shape)"},
           413: {"model": models.ErrorBody, "description": "Body larger than the configured limit"}}

_SCORE_TAIL = [b',"Score":%d},' % s for s in range(11)]

PREEMPT_RULE = (
    "Keeps a candidate node, with its victims unchanged, only if evicting them frees a GPU subset that meets the "
    "pod's need (count, require-nvlink, min-allreduce-gbps); drops it otherwise. Victims' GPUs come from their plan "
    "annotations; a victim without a plan frees no known GPUs. Victims are never trimmed. Among kept nodes whose "
    "victims cost the same (PDB violations, highest and summed victim priority, victim count), only those freeing the "
    "fastest subset stay."
)


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


def _body(model: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise wire.BodyTooLarge(f"body of {length} bytes exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise wire.BodyTooLarge(f"body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client went away or broke the framing mid-body: its fault, not an internal error
        raise wire.BadRequest(f"the body ended early after {size} bytes (client disconnected)") from None
    return b"".join(chunks)


def encode_answer(result: Any) -> bytes:
    """orjson writes at most 255 levels of nesting; filter echoes Node objects, which may be deeper than that."""
    try:
        return orjson.dumps(result)
    except orjson.JSONEncodeError as e:
        raise wire.BadRequest(f"the answer would repeat an object of the request that cannot be written back ({e}: "
                              "nested too deeply)") from None


def _filter_result(passed: list[str] | None, nodes: dict[str, Any] | None, failed: dict[str, str],
                   unresolvable: dict[str, str], error: str) -> dict[str, Any]:
    return {"Nodes": nodes, "NodeNames": passed, "FailedNodes": failed,
            "FailedAndUnresolvableNodes": unresolvable, "Error": error}


def _meta_victims(candidates: dict[str, NodeVictims]) -> dict[str, Any]:
    return {node: {"Pods": [{"UID": v.uid} for v in nv.victims], "NumPDBViolations": nv.pdb_violations}
            for node, nv in candidates.items()}


class Verbs:
    """The four verbs over an Extender; each takes decoded JSON and returns the answer as plain data (or, for
    prioritize, as ready JSON bytes)."""

    def __init__(self, ext: Extender) -> None:
        self.ext = ext
        cfg = ext.config
        self._needs_args = (cfg.resource_name, cfg.keys)

    def filter(self, data: Any) -> dict[str, Any]:
        args = wire.extender_args(data)
        ext = self.ext
        try:
            needs = pod_needs(args.pod, *self._needs_args)
        except PodSpecError as e:
            return _filter_result(None if args.node_names is None else [], None if args.nodes is None else
                                  {**args.nodes, "items": []}, {}, {}, f"pod cannot be placed: {e}")
        ext.recent.remember(needs)
        extra = self._extra_entries(args)
        out = ext.placement.filter(args.names, needs.need, extra)
        m = ext.metrics.filter_nodes
        m.labels("passed").inc(len(out.passed))
        m.labels("failed").inc(len(out.failed))
        m.labels("unresolvable").inc(len(out.unresolvable))
        nodes = None
        if args.nodes is not None and args.items is not None:
            keep = set(out.passed)
            nodes = {**args.nodes, "items": [it for it in args.items if it["metadata"]["name"] in keep]}
        return _filter_result(out.passed if args.node_names is not None else None, nodes, out.failed,
                              out.unresolvable, "")

    def prioritize(self, data: Any) -> bytes:
        args = wire.extender_args(data)
        try:
            needs = pod_needs(args.pod, *self._needs_args)
        except PodSpecError as e:
            log.info("extender.prioritize.bad_pod", error=str(e))
            return self._host_priority_list(args.names, [0] * len(args.names))
        self.ext.recent.remember(needs)
        scores = self.ext.placement.score(args.names, needs.need, self._extra_entries(args))
        return self._host_priority_list(args.names, scores)

    @staticmethod
    def _host_priority_list(names: list[str], scores: list[int]) -> bytes:
        """The HostPriorityList JSON built by C-level joins (no Python code per node): orjson quotes every name in
        one call, and names without commas (every valid node name) split back apart on the commas."""
        if not names:
            return b"[]"
        quoted = orjson.dumps(names)[1:-1].split(b",")
        if len(quoted) != len(names):  # a name with a comma in it: encode the slow way
            return orjson.dumps([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)])
        body = b"".join(chain.from_iterable(zip(repeat(b'{"Host":'), quoted, map(_SCORE_TAIL.__getitem__, scores))))
        return b"[" + body[:-1] + b"]"

    async def bind(self, data: Any) -> dict[str, Any]:
        req = wire.binding_args(data)
        return {"Error": await self.ext.binder.bind(req)}

    def preempt(self, data: Any) -> dict[str, Any]:
        args = wire.preemption_args(data, self.ext.config.keys.plan)
        try:
            needs = pod_needs(args.pod, *self._needs_args)
        except PodSpecError as e:
            log.info("extender.preempt.bad_pod", error=str(e))
            return {"NodeNameToMetaVictims": _meta_victims(args.candidates)}
        kept = keep_victims(self.ext.cache, self.ext.placement, needs.need, args.candidates, self.ext.plan_of)
        return {"NodeNameToMetaVictims": _meta_victims(kept)}

    def _extra_entries(self, args: wire.ExtenderArgs) -> dict[str, Any] | None:
        """Not nodeCacheCapable: nodes the cache has not seen yet are read from the NodeList itself."""
        if args.items is None:
            return None
        known = self.ext.cache.nodes
        extra = {}
        for item in args.items:
            name = item["metadata"]["name"]
            if name not in known:
                extra[name] = self.ext.cache.entry_from_node(item)
        return extra or None


def _error_body(verb: str, message: str) -> Any:
    if verb == "filter":
        return _filter_result(None, None, {}, {}, message)
    if verb == "prioritize":
        return []
    if verb == "preempt":
        return {"NodeNameToMetaVictims": None}
    return {"Error": message}


def _add_health_routes(app: FastAPI, ext: Extender) -> None:
    """GET /healthz, /readyz and /metrics: read-only, nothing secret, the same on the API and the metrics port."""

    @app.get("/healthz", summary="Liveness", response_class=Response)
    async def healthz() -> Response:
        return Response(b"ok", media_type="text/plain")

    @app.get("/readyz", summary="Readiness: the node cache holds a full snapshot", response_class=Response)
    async def readyz() -> Response:
        if ext.ready():
            return Response(b"ok", media_type="text/plain")
        return Response(b"node cache not synced yet", status_code=503, media_type="text/plain")

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics_() -> Response:
        return Response(ext.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


def create_metrics_app(ext: Extender) -> FastAPI:
    """Health, readiness and metrics alone, for a second listener (`gpu-extender serve --metrics-port`): a sidecar
    whose API stays on loopback can still be scraped by Prometheus and probed by the kubelet over plain HTTP, since
    nothing here changes state or says anything secret. The extender's lifecycle belongs to the API app."""
    app = FastAPI(title="gpu-extender metrics", version="1", openapi_url=None, docs_url=None, redoc_url=None)
    _add_health_routes(app, ext)
    return app


def create_app(ext: Extender, *, manage_lifecycle: bool = True) -> FastAPI:
    """The FastAPI app. With manage_lifecycle the app starts and stops the extender (watches, expiry thread)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            ext.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                ext.stop()

    app = FastAPI(
        title="gpu-extender",
        version="1",
        description="Topology-aware kube-scheduler HTTP extender for GPUs (filter, prioritize, bind, preempt).",
        lifespan=lifespan,
    )
    verbs = Verbs(ext)
    limit = ext.config.max_body_bytes
    metrics = ext.metrics

    async def handle(verb: str, request: Request, fn: Callable[[Any], Any]) -> Response:
        started = time.perf_counter()
        code = 200
        try:
            body = await read_body(request, limit)
            with _no_cyclic_gc():
                result = fn(wire.decode(body))
                del body
                pending = result if isinstance(result, Awaitable) else None
                if pending is None:
                    content = result if isinstance(result, bytes) else encode_answer(result)
                del result  # the decoded body and the answer are freed by refcount before the collector is back
            if pending is not None:  # bind: awaits the apiserver with the collector running
                content = orjson.dumps(await pending)
        except wire.BadRequest as e:
            code = 400
            metrics.bad_requests.labels(verb).inc()
            content = orjson.dumps({"Error": f"malformed {_BODY[verb]}: {e}"})
        except wire.BodyTooLarge as e:
            code = 413
            metrics.bad_requests.labels(verb).inc()
            content = orjson.dumps({"Error": str(e)})
        except Exception as e:
            log.exception("extender.verb.internal_error", verb=verb)
            metrics.internal_errors.labels(verb).inc()
            content = orjson.dumps(_error_body(verb, f"gpu-extender internal error in {verb}: {type(e).__name__}: {e}"))
        metrics.requests.labels(verb, str(code)).inc()
        metrics.latency.labels(verb).observe(time.perf_counter() - started)
        return Response(content, status_code=code, media_type=JSON)

    @app.post("/filter", summary="Filter nodes for a GPU pod", openapi_extra=_body("ExtenderArgs"),
              responses={200: {"model": models.ExtenderFilterResult}, **_ERRORS}, response_class=Response)
    async def filter_(request: Request) -> Response:
        return await handle("filter", request, verbs.filter)

    @app.post("/prioritize", summary="Score nodes 0-10 for a GPU pod", openapi_extra=_body("ExtenderArgs"),
              responses={200: {"model": models.HostPriorityList}, **_ERRORS}, response_class=Response)
    async def prioritize(request: Request) -> Response:
        return await handle("prioritize", request, verbs.prioritize)

    @app.post("/bind", summary="Bind a pod with its GPU plan", openapi_extra=_body("ExtenderBindingArgs"),
              responses={200: {"model": models.ExtenderBindingResult}, **_ERRORS}, response_class=Response)
    async def bind(request: Request) -> Response:
        return await handle("bind", request, verbs.bind)

    @app.post("/preempt", summary="Keep victims whose eviction frees a suitable GPU subset",
              description=PREEMPT_RULE, openapi_extra=_body("ExtenderPreemptionArgs"),
              responses={200: {"model": models.ExtenderPreemptionResult}, **_ERRORS}, response_class=Response)
    async def preempt(request: Request) -> Response:
        return await handle("preempt", request, verbs.preempt)

    _add_health_routes(app, ext)

    if ext.inventory is not None:
        inventory = ext.inventory

        @app.get("/inventory", summary="Standalone mode: nodes, free GPUs and bound plans", response_class=Response)
        async def get_inventory() -> Response:
            return Response(orjson.dumps(inventory.snapshot()), media_type=JSON)

        @app.delete("/inventory/pods/{uid}", summary="Standalone mode: free a bound pod's GPUs",
                    response_class=Response)
        async def release_pod(uid: str) -> Response:
            rec = inventory.release(uid)
            if rec is None:
                return Response(orjson.dumps({"Error": f"no bound pod with uid {uid}"}), status_code=404,
                                media_type=JSON)
            return Response(orjson.dumps({"Error": "", "released": sorted(rec.plan.ids) if rec.plan else []}),
                            media_type=JSON)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models.REQUEST_MODELS:
            js = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
