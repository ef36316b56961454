"""Shared test setup. `SHARED` is the read-only fixture tree (../shared next to the repository); `fake` is an
in-process kube-apiserver and `api` the official client pointed at it."""

from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest

from gpuplugin.kube import make_api_client
from tests.fakes.kubeapi import FakeKubeApi

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    assert SHARED.is_dir(), f"shared fixtures not found at {SHARED}"
    return SHARED


@pytest.fixture
def fake() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as server:
        yield server


@pytest.fixture
def api(fake: FakeKubeApi) -> Iterator[kubernetes.client.ApiClient]:
    client = make_api_client(host=fake.url, timeout_s=5.0)
    yield client
    client.close()
