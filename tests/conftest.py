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
    "test_lm_eval": "transformers",
}
# The longest groups (a full run's --durations on 2 cores, most first) start first, so that
# the two workers finish together instead of one running the longest module alone at the end.
LONGEST = ["test_router", "transformers", "test_tensor_parallel_stack", "test_recovery",
           "test_sampling_features", "test_admission_security", "test_rotasched",
           "shared_stack", "test_executor", "test_tensor_parallel"]


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0].removesuffix(".py")
    module = path.rsplit("/", 1)[-1]
    return GROUPS.get(module, module if module in LONGEST else path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs on two xdist workers: each module's tests on one worker (its
    module-scoped stack or model starts once), GROUPS' modules together, LONGEST first.
    A scheduler of our own rather than `--dist loadgroup`: xdist 3.8 tags a test's group by
    rewriting its node id, which pytest 9.2 ignores, so every test went its own way and a
    module's stack started on both workers."""
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        ordered = False
        workqueue: OrderedDict[str, dict[str, bool]]

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:
                self.ordered = True
                rank = {g: i for i, g in enumerate(LONGEST)}
                order = sorted(self.workqueue, key=lambda g: rank.get(g, len(LONGEST)))
                self.workqueue = OrderedDict((g, self.workqueue[g]) for g in order)
            super()._assign_work_unit(node)

    return ModuleGroups(config, log)


@pytest.hookimpl(tryfirst=True)
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


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real four-service stack for the modules that test what its clients notice
    (tests/stack.py); started on first use, stopped at the end of the session."""
    from tests.stack import start_stack

    with start_stack(tmp_path_factory.mktemp("shared-stack")) as s:
        yield s
