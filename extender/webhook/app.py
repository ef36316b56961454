"""The webhook's HTTP face: POST /mutate (AdmissionReview v1), GET /healthz /readyz /metrics.

Whatever goes wrong inside, a review that names a uid is answered 200 and allowed (with a warning when something
failed): the webhook must never be the reason a pod is not created. A body that is not a review (no uid to answer
to), or too large, gets 400/413, which the API server treats as a failed call and, under failurePolicy Ignore,
admits the pod unchanged.
"""

from __future__ import annotations

import time

import orjson
import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from extender.http.bodies import BadRequest, BodyTooLarge, decode, read_body
from extender.webhook import review
from extender.webhook.metrics import WebhookMetrics

log = structlog.get_logger(__name__)

JSON = "application/json"
_PLAIN = "text/plain"

router = APIRouter()


@router.post("/mutate", summary="Mutating admission review (AdmissionReview v1)", response_class=Response)
async def mutate(request: Request) -> Response:
    state = request.app.state
    metrics: WebhookMetrics = state.metrics
    started = time.perf_counter()
    try:
        body = await read_body(request, state.max_body_bytes)
        rev = review.read_review(decode(body))
    except BodyTooLarge as e:
        return _refused(metrics, 413, str(e))
    except (BadRequest, review.ReviewError) as e:
        return _refused(metrics, 400, f"not an AdmissionReview request: {e}")
    try:
        decision = review.decide(rev.request, state.policy)
    except Exception as e:  # the pod must still be created: answer allowed, say so
        log.exception("extender.webhook.internal_error", pod=rev.pod_name)
        decision = review.failed(e)
    content = orjson.dumps(review.answer(rev, decision))
    metrics.reviews.labels(decision.outcome).inc()
    metrics.latency.observe(time.perf_counter() - started)
    if decision.outcome == review.PATCHED:
        log.info("extender.webhook.patched", pod=rev.pod_name, gpus=decision.gpus,
                 scheduler=state.policy.scheduler_name)
    elif decision.warning:
        log.info("extender.webhook.left_alone", pod=rev.pod_name, outcome=decision.outcome, warning=decision.warning)
    return Response(content, media_type=JSON)


def _refused(metrics: WebhookMetrics, code: int, message: str) -> Response:
    metrics.bad_requests.inc()
    log.info("extender.webhook.bad_request", code=code, error=message)
    return Response(orjson.dumps({"error": message}), status_code=code, media_type=JSON)


health = APIRouter()


@health.get("/healthz", summary="Liveness", response_class=Response)
async def healthz() -> Response:
    return Response(b"ok", media_type=_PLAIN)


@health.get("/readyz", summary="Readiness (no state to wait for)", response_class=Response)
async def readyz() -> Response:
    return Response(b"ok", media_type=_PLAIN)


@health.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics_(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _app(title: str, metrics: WebhookMetrics) -> FastAPI:
    app = FastAPI(title=title, version="1", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.include_router(health)
    return app


def create_app(policy: review.Policy, metrics: WebhookMetrics, max_body_bytes: int) -> FastAPI:
    """The HTTPS app the API server calls."""
    app = _app("gpu-extender webhook", metrics)
    app.state.policy = policy
    app.state.max_body_bytes = max_body_bytes
    app.include_router(router)
    return app


def create_metrics_app(metrics: WebhookMetrics) -> FastAPI:
    """Health, readiness and metrics alone, for the plain-HTTP --metrics-port listener."""
    return _app("gpu-extender webhook metrics", metrics)
