"""Choosing the worker's device, and refusing a KV pool that does not fit on the GPU
(worker/cuda/device.py). The CPU tests run the decisions with the machine's facts given;
the `gpu` tests run them against the real card."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from common.config import EngineConfig
from worker.cuda.device import GIB, DeviceError, check_pool_fits, resolve_device


def test_auto_takes_the_gpu_only_when_there_is_one() -> None:
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True, triton_available=True) == "cuda"
    assert resolve_device("cpu", cuda_available=True) == "cpu"


def test_cuda_without_cuda_or_triton_is_one_clear_error() -> None:
    with pytest.raises(DeviceError, match=r"--device cuda: torch sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(DeviceError, match=r"needs Triton.*superinfer\[gpu\]"):
        resolve_device("cuda", cuda_available=True, triton_available=False)
    with pytest.raises(DeviceError, match="must be one of"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="--device must be auto, cpu or cuda"):
        EngineConfig(device="gpu")


def test_worker_cli_with_device_cuda_and_no_gpu_exits_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # No GPU visible, on any machine: the same check runs on the GPU machine too.
    p = subprocess.run(
        [sys.executable, "-m", "superinfer.cli", "worker", "--device", "cuda",
         "--run-dir", str(tmp_path), "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: torch sees no CUDA device" in lines[0], p.stderr
    assert not (tmp_path / "worker.pid").exists()  # it never started


def test_a_pool_larger_than_free_memory_is_refused_naming_the_sizes() -> None:
    mib4 = 4 << 20
    check_pool_fits(1000, mib4, free_bytes=8 * GIB, total_bytes=141 * GIB)  # 3.9 + 2 < 8
    with pytest.raises(DeviceError) as e:
        check_pool_fits(30_000, mib4, free_bytes=100 * GIB, total_bytes=141 * GIB)
    msg = str(e.value)
    assert "30000 blocks x 4.00 MiB = 117.19 GiB" in msg
    assert "only 100.00 GiB of the GPU's 141.00 GiB are free" in msg
    assert "At most 25088 blocks fit" in msg  # (100 - 2) GiB / 4 MiB


@pytest.mark.gpu
def test_gpu_pool_too_large_leaves_nothing_allocated() -> None:
    from worker.cuda.device import allocate_cuda_pool

    dev = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(dev)
    before = torch.cuda.memory_allocated(dev)
    blocks = free // (256 << 10) + 10  # 256 KiB blocks: more than the card has free
    with pytest.raises(DeviceError, match="does not fit on the GPU"):
        allocate_cuda_pool((blocks, 4, 2, 16, 8, 128), torch.bfloat16, dev)
    assert torch.cuda.memory_allocated(dev) == before
    small = allocate_cuda_pool((4, 2, 2, 16, 2, 64), torch.bfloat16, dev)
    assert small.shape == (4, 2, 2, 16, 2, 64) and not bool(small.any())


CHILD = """
import sys, torch
from kvmem_svc.pool import DeviceMapping
from proto import worker_pb2
h = worker_pb2.KVPoolHandle.FromString(bytes.fromhex(sys.stdin.read()))
m = DeviceMapping(h)
m.tensor[1].fill_(7)
torch.cuda.synchronize()
print(m.pool_id, m.kind, float(m.tensor.float().sum()))
"""


@pytest.mark.gpu
def test_gpu_pool_is_shared_with_another_process_through_its_ipc_handle() -> None:
    """What kvmem does with the worker's pool: open it from the handle message, write it."""
    from worker.cuda.device import cuda_device_pool

    pool = cuda_device_pool((3, 2, 2, 16, 2, 64), torch.bfloat16, torch.device("cuda"))
    handle = pool.handle()
    assert handle.kind == "cuda_ipc" and handle.cuda_ipc_handle and not handle.shm_name
    p = subprocess.run([sys.executable, "-c", CHILD], input=handle.SerializeToString().hex(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    block = 2 * 2 * 16 * 2 * 64
    assert p.stdout.split() == [pool.pool_id, "cuda_ipc", f"{7.0 * block}"]
    assert pool.tensor[1].eq(7).all() and not pool.tensor[0].any() and not pool.tensor[2].any()
