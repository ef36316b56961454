"""Conversion of client exceptions and Status objects into typed errors."""

from __future__ import annotations

import json

import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from gputopo.kube import (
    ApiUnavailable,
    Conflict,
    Gone,
    Invalid,
    KubeApiError,
    NotFound,
    ServerError,
    TooManyRequests,
    error_from_api_exception,
    error_from_status,
    to_kube_error,
)
from tests.helpers.paths import APISERVER_RECORDINGS


def recorded_status(name: str) -> dict:
    return json.loads((APISERVER_RECORDINGS / name).read_text())["response"]["body"]


@pytest.mark.parametrize(("name", "cls", "reason"), [
    ("node-not-found.json", NotFound, "NotFound"),
    ("pod-binding-conflict.json", Conflict, "Conflict"),
    ("list-continue-expired-410.json", Gone, "Expired"),
    ("node-patch-invalid-422.json", Invalid, "Invalid"),
])
def test_recorded_status_bodies_map_to_types(name, cls, reason):
    body = recorded_status(name)
    exc = ApiException(status=body["code"], reason="ignored", body=json.dumps(body))
    err = error_from_api_exception(exc, operation="op")
    assert type(err) is cls
    assert (err.status, err.reason, err.message, err.body) == (body["code"], reason, body["message"], body)
    assert str(err).startswith(f"op: {body['code']} {reason}: ")


def test_watch_error_event_status_is_gone():
    event = json.loads((APISERVER_RECORDINGS / "watch-expired-410.json").read_text())["response"]["events"][0]
    err = error_from_status(event["object"])
    assert isinstance(err, Gone) and err.message.startswith("too old resource version")


def test_non_json_error_body_keeps_text():
    err = error_from_api_exception(ApiException(status=502, reason="Bad Gateway", body=b"<html>proxy</html>"))
    assert isinstance(err, ServerError) and err.body is None and "proxy" in err.message and err.retryable


def test_429_and_unknown_codes():
    assert isinstance(error_from_status({"code": 429, "reason": "TooManyRequests"}), TooManyRequests)
    err = error_from_status({"code": 418, "message": "teapot"})
    assert type(err) is KubeApiError and err.status == 418


def test_connection_errors_are_api_unavailable():
    err = to_kube_error(urllib3.exceptions.ProtocolError("Connection aborted"), operation="watch nodes")
    assert isinstance(err, ApiUnavailable) and err.status == 0
    assert isinstance(to_kube_error(ConnectionRefusedError(111, "refused")), ApiUnavailable)
    assert isinstance(error_from_api_exception(ApiException(status=0, reason="SSLError")), ApiUnavailable)
    assert to_kube_error(ZeroDivisionError()) is None
