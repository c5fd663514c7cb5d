"""Shared pytest hooks: GPU-marked tests are skipped on machines without CUDA.

On a machine without an NVIDIA driver, Triton's interpreter is switched on for the whole
run (it must be before triton is first imported), so the CUDA path's Triton kernels run on
CPU tensors in tests (worker/cuda/kernels.py). A GPU run sets TRITON_INTERPRET=0 itself
(scripts/gpu_check.sh), so the same tests check the compiled kernels there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"

import superinfer  # noqa: F401  (OpenMP wait policy, before anything loads torch)

# Modules that share something costly run on one xdist worker, so that it is made once:
# the session's stack (tests/stack.py), transformers' model of the GGUF file
# (tests/hf_reference.py).
GROUPS = {
    "test_gateway": "shared_stack", "test_openai_features": "shared_stack",
    "test_bench_serve": "shared_stack",
    "test_engine_vs_hf": "transformers", "test_prefix_cache_model": "transformers",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `make test` runs on two xdist workers with --dist loadgroup: a module's tests stay
    # together (its module-scoped stack or model starts once), GROUPS' modules too.
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else item.nodeid
        group = GROUPS.get(module, module)
        item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # imported only when needed: it takes seconds and most runs never need it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real four-service stack for the modules that test what its clients notice
    (tests/stack.py); started on first use, stopped at the end of the session."""
    from tests.stack import start_stack

    with start_stack(tmp_path_factory.mktemp("shared-stack")) as s:
        yield s
