"""The HTTP face of the extender: the FastAPI apps, assembled from the routers in extender.http.routers.

An app carries its Extender (and the Verbs over it) on `app.state`; routes reach them through the dependencies of
extender.http.dependencies. Errors and bodies of the verbs are extender.http.answers' business, their logic
extender.verbs'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from extender.http import models
from extender.http.answers import VERB_PATHS, answer
from extender.http.routers import health, inventory, scheduler
from extender.service import Extender
from extender.verbs import Verbs


class ExtenderAPI(FastAPI):
    """FastAPI whose schema also publishes the request models of the verbs: the verbs read their bodies themselves
    (no pydantic on the hot path), so FastAPI cannot see them, and the routes refer to them by name.

    The four verbs are the scheduling cycle's critical path (kube-scheduler waits for filter and prioritize, one pod
    at a time): a POST to one of them goes straight to extender.http.answers.answer, past Starlette's middleware
    stack, router and endpoint wrapping, which took about a third of the event loop's time under bind load (issue
    24, py-spy). The answer is the same one the routes in extender.http.routers.scheduler give (they call the same
    function, and describe the verbs in the OpenAPI schema); every other request goes through FastAPI."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            verb = VERB_PATHS.get(scope["path"])
            verbs: Verbs | None = getattr(self.state, "verbs", None)
            if verb is not None and verbs is not None:
                response = await answer(Request(scope, receive), verb, getattr(verbs, verb), verbs.ext)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema:
            return self.openapi_schema
        schema = super().openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models.REQUEST_MODELS:
            js = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = js
        self.openapi_schema = schema
        return schema


@asynccontextmanager
async def run_extender(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan: the extender's watches and expiry thread start with the server and stop with it."""
    ext: Extender = app.state.extender
    ext.start()
    try:
        yield
    finally:
        ext.stop()


def create_app(ext: Extender, *, manage_lifecycle: bool = True) -> FastAPI:
    """The API app. With manage_lifecycle the app starts and stops the extender (watches, expiry thread)."""
    app = ExtenderAPI(
        title="gpu-extender",
        version="1",
        description="Topology-aware kube-scheduler HTTP extender for GPUs (filter, prioritize, bind, preempt).",
        lifespan=run_extender if manage_lifecycle else None,
    )
    app.state.extender = ext
    app.state.verbs = Verbs(ext)
    app.include_router(scheduler.router)
    app.include_router(health.router)
    if ext.inventory is not None:
        app.include_router(inventory.router)
    return app


def create_metrics_app(ext: Extender) -> FastAPI:
    """Health, readiness and metrics alone, for a second listener (`gpu-extender serve --metrics-port`): a sidecar
    whose API stays on loopback can still be scraped by Prometheus and probed by the kubelet over plain HTTP, since
    nothing here changes state or says anything secret. The extender's lifecycle belongs to the API app."""
    app = FastAPI(title="gpu-extender metrics", version="1", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.extender = ext
    app.include_router(health.router)
    return app
