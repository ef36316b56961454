"""Shared test setup. `SHARED` is the read-only fixture tree (../shared next to the repository)."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    assert SHARED.is_dir(), f"shared fixtures not found at {SHARED}"
    return SHARED
