"""The app's state, reached by the routes through FastAPI's dependencies.

extender.http.app puts the Extender and its Verbs on `app.state` when it builds the app; routes declare what they need
(`metrics: MetricsDep`) and FastAPI hands it in, so no route closes over the objects of one app and several apps
(the API and the metrics listener, or the tests' many extenders) share the same route code. The four scheduler
verbs read `request.app.state.verbs` directly (extender.http.routers.scheduler says why). The functions are async:
FastAPI would run plain ones in its thread pool, a thread hop per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from extender.metrics import ExtenderMetrics
from extender.service import Extender
from extender.state.inventory import Inventory


async def get_extender(request: Request) -> Extender:
    return request.app.state.extender


async def get_metrics(request: Request) -> ExtenderMetrics:
    return request.app.state.extender.metrics


async def get_standalone_inventory(request: Request) -> Inventory:
    """Standalone mode only: a cluster-fed extender has no inventory to show (404, as for any unknown path)."""
    inventory: Inventory | None = request.app.state.extender.inventory
    if inventory is None:
        raise HTTPException(status_code=404)
    return inventory


ExtenderDep = Annotated[Extender, Depends(get_extender)]
MetricsDep = Annotated[ExtenderMetrics, Depends(get_metrics)]
InventoryDep = Annotated[Inventory, Depends(get_standalone_inventory)]
