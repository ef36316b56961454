"""Property test from the published OpenAPI schema, over real HTTP: schemathesis sends bodies that keep the schema
(they must be answered 200 in the schema of the answer) and bodies that break it (they must get 400), and no verb
ever hits its internal-error path."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from extender.config import ExtenderConfig
from extender.service import Extender
from tests.extender.conftest import A100, DGX1, running, write_inventory


@pytest.mark.parametrize("verb", ["/filter", "/prioritize", "/bind", "/preempt"])
def test_verbs_keep_their_published_schema(tmp_path: Path, verb: str) -> None:
    inv = write_inventory(tmp_path / "inv.yaml", [{"name": "a100", "topology": A100},
                                                  {"name": "dgx", "topology": DGX1, "used": [0, 1]}])
    ext = Extender.standalone(inv, ExtenderConfig(max_body_bytes=64 * 1024))
    with running(ext) as client:
        base = str(client.base_url)
        schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
        operation = schema[verb]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=base)

            check()
        text = client.get("/metrics").text
    assert "gpu_extender_internal_errors_total{" not in text  # no labelled sample: never counted
