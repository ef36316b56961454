"""Standalone mode's inventory: GET /inventory shows nodes, free GPUs and bound plans; DELETE
/inventory/pods/{uid} frees a bound pod's GPUs as if it had finished (the demo and the benchmarks use both)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from extender.http.dependencies import InventoryDep

JSON = "application/json"

router = APIRouter()


@router.get("/inventory", summary="Standalone mode: nodes, free GPUs and bound plans", response_class=Response)
async def get_inventory(inventory: InventoryDep) -> Response:
    return Response(orjson.dumps(inventory.snapshot()), media_type=JSON)


@router.delete("/inventory/pods/{uid}", summary="Standalone mode: free a bound pod's GPUs", response_class=Response)
async def release_pod(uid: str, inventory: InventoryDep) -> Response:
    rec = inventory.release(uid)
    if rec is None:
        return Response(orjson.dumps({"Error": f"no bound pod with uid {uid}"}), status_code=404, media_type=JSON)
    return Response(orjson.dumps({"Error": "", "released": sorted(rec.plan.ids) if rec.plan else []}),
                    media_type=JSON)
