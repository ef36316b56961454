"""kube-scheduler's verbs: POST /filter, /prioritize, /bind and /preempt (the extender's managedResources verbs).

Each route hands its request to extender.http.answers.answer, which owns the body, the errors and the metrics; the
bodies are declared in the OpenAPI schema by reference (openapi_extra) because no route parses them with pydantic.

These four routes are the scheduling hot path: on the ExtenderAPI app (extender.http.app) a POST to one of them is
answered by the same `answer` call before FastAPI's router is reached; the routes describe them in the schema and
answer them on any other app. They read the Verbs from `request.app.state` themselves rather than through a
`Depends` (extender.http.dependencies), which costs about 17 us per request: 10% of a 100-node filter.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from extender.http import models
from extender.http.answers import JSON, answer
from extender.verbs import Verbs

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": models.ErrorBody, "description": "Malformed body (not JSON, or not this shape)"},
    413: {"model": models.ErrorBody, "description": "Body larger than the configured limit"},
}

PREEMPT_RULE = (
    "Keeps a candidate node, with its victims unchanged, only if evicting them frees a GPU subset that meets the "
    "pod's need (count, require-nvlink, min-allreduce-gbps); drops it otherwise. Victims' GPUs come from their plan "
    "annotations; a victim without a plan frees no known GPUs. Victims are never trimmed. Among kept nodes whose "
    "victims cost the same (PDB violations, highest and summed victim priority, victim count), only those freeing the "
    "fastest subset stay."
)


def _body(model: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


@router.post("/filter", summary="Filter nodes for a GPU pod", openapi_extra=_body("ExtenderArgs"),
             responses={200: {"model": models.ExtenderFilterResult}, **_ERRORS}, response_class=Response)
async def filter_(request: Request) -> Response:
    verbs: Verbs = request.app.state.verbs
    return await answer(request, "filter", verbs.filter, verbs.ext)


@router.post("/prioritize", summary="Score nodes 0-10 for a GPU pod", openapi_extra=_body("ExtenderArgs"),
             responses={200: {"model": models.HostPriorityList}, **_ERRORS}, response_class=Response)
async def prioritize(request: Request) -> Response:
    verbs: Verbs = request.app.state.verbs
    return await answer(request, "prioritize", verbs.prioritize, verbs.ext)


@router.post("/bind", summary="Bind a pod with its GPU plan", openapi_extra=_body("ExtenderBindingArgs"),
             responses={200: {"model": models.ExtenderBindingResult}, **_ERRORS}, response_class=Response)
async def bind(request: Request) -> Response:
    verbs: Verbs = request.app.state.verbs
    return await answer(request, "bind", verbs.bind, verbs.ext)


@router.post("/preempt", summary="Keep victims whose eviction frees a suitable GPU subset",
             description=PREEMPT_RULE, openapi_extra=_body("ExtenderPreemptionArgs"),
             responses={200: {"model": models.ExtenderPreemptionResult}, **_ERRORS}, response_class=Response)
async def preempt(request: Request) -> Response:
    verbs: Verbs = request.app.state.verbs
    return await answer(request, "preempt", verbs.preempt, verbs.ext)
