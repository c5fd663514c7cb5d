"""Shared pytest hooks: GPU-marked tests are skipped on machines without CUDA."""

from __future__ import annotations

import pytest

import superinfer  # noqa: F401  (OpenMP wait policy, before anything loads torch)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # imported only when needed: it takes seconds and most runs never need it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)
