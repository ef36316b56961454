"""The fakes' own tests: every server thread a test here starts must be gone when it ends (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads: None) -> None:
    """Applies the suite's thread-leak check to every test in tests/fakes."""
