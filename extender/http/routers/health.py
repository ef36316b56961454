"""GET /healthz, /readyz and /metrics: read-only, nothing secret, the same on the API and the metrics port."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from extender.http.dependencies import ExtenderDep, MetricsDep

router = APIRouter()

_PLAIN = "text/plain"


@router.get("/healthz", summary="Liveness", response_class=Response)
async def healthz() -> Response:
    return Response(b"ok", media_type=_PLAIN)


@router.get("/readyz", summary="Readiness: every watch has listed, and under election the Lease can be reached",
            response_class=Response)
async def readyz(ext: ExtenderDep) -> Response:
    why = ext.not_ready()
    if why is None:
        return Response(b"ok", media_type=_PLAIN)
    return Response(why.encode(), status_code=503, media_type=_PLAIN)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics_(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")
