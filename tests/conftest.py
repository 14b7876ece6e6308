"""Shared fixtures: the ``device`` fixture runs a test on the host device and, where a GPU is
usable, on CUDA; tests marked ``cuda`` skip with the reason when no GPU is usable."""

from __future__ import annotations

import pytest

from streamlane.runtime import cuda as _cuda
from streamlane.runtime import get_device


def _cuda_reason() -> str | None:
    return _cuda.why_unusable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a usable CUDA GPU: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest):
    """The device under test: ``host`` everywhere, ``cuda`` where a GPU is usable."""
    dev = get_device(request.param)
    yield dev
    if dev.kind == "host":
        dev.synchronize()


@pytest.fixture
def host():
    dev = get_device("host")
    yield dev
    dev.reset_error()


@pytest.fixture
def cuda_device():
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(f"needs a usable CUDA GPU: {reason}")
    return get_device("cuda")
