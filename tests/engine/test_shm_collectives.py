"""The shared-memory all-reduce and gather of CPU tensor-parallel ranks (``replica/worker/shm_all_reduce.py``
and its C++ op ``carpool_cpu::shm_collective``), between two real processes: the C++ op's sums
are bit for bit the Python path's (torch's own adds, in rank order) in every dtype a model runs
in, the gather joins the ranks' parts in rank order on rank 0 (also when the other rank runs
ahead through several gathers), and a late peer is waited for (the op hands back to Python
between waits to check that the peers live)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from replica.kernels import cpu_kernels
from replica.worker import shm_all_reduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.available(), reason="needs /dev/shm on x86-64")
SHAPES = [(1, 896), (4, 896), (3, 5, 7), (64, 96)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def part(rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def rank_main(rank: int, path: str, max_bytes: int, native: bool, out: str) -> None:
    reducer = shm_all_reduce.ShmAllReduce(rank, 2, path, max_bytes)
    reducer.native = native and reducer.native
    results = {}
    for dtype in DTYPES:
        for shape in SHAPES:
            if rank == 1 and shape == (3, 5, 7):
                time.sleep(0.3)  # rank 0 waits past several of the op's wait slices
            results[("sum", str(dtype), shape)] = reducer(part(rank, shape, dtype))
    for shape in [(4, 48), (1, 10)] if reducer.native else []:  # the Python path gathers through gloo
        gathered = torch.ops.carpool.shm_gather(part(rank, shape, torch.bfloat16), reducer.key, 2)
        results[("gather", shape)] = gathered if rank == 0 else None
        results[("sum-after", shape)] = reducer(part(rank, (2, 8), torch.float32))  # the next call still pairs up
    if reducer.native:  # three gathers in a row, rank 0 late: rank 1 must not overwrite a half unread
        if rank == 0:
            time.sleep(0.3)
        for i in range(3):
            got = torch.ops.carpool.shm_gather(part(rank, (2, 4 + i), torch.float32), reducer.key, 2)
            results[("gather-run", i)] = got if rank == 0 else None
    torch.save(results, out)


def run_pair(tmp_path, native: bool) -> list[dict]:
    max_bytes = 64 * 1024
    path = f"/dev/shm/carpool-test-{os.getpid()}-{int(native)}"
    with open(path, "wb") as f:
        f.truncate(shm_all_reduce.buffer_bytes(2, max_bytes))
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"rank{r}-{native}.pt") for r in range(2)]
    procs = [ctx.Process(target=rank_main, args=(r, path, max_bytes, native, outs[r])) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        os.unlink(path)
        for p in procs:
            if p.is_alive():
                p.kill()
    return [torch.load(o) for o in outs]


def test_native_sums_and_gathers_equal_torch_bit_for_bit(tmp_path):
    assert cpu_kernels.load(), "the CPU kernels did not build"
    native = run_pair(tmp_path, native=True)
    python = run_pair(tmp_path, native=False)
    for dtype in DTYPES:
        for shape in SHAPES:
            key = ("sum", str(dtype), shape)
            expected = part(0, shape, dtype).clone().add_(part(1, shape, dtype))  # torch's add, rank order
            for results in (native, python):
                for rank in (0, 1):
                    got = results[rank][key]
                    assert got.dtype == dtype and got.shape == shape
                    assert torch.equal(got, expected), key
    for shape in [(4, 48), (1, 10)]:
        expected = torch.cat([part(0, shape, torch.bfloat16), part(1, shape, torch.bfloat16)], dim=-1)
        assert torch.equal(native[0][("gather", shape)], expected)
        assert native[1][("gather", shape)] is None  # rank 1 publishes its part and goes on
        assert torch.equal(native[0][("sum-after", shape)], native[1][("sum-after", shape)])
    for i in range(3):
        expected = torch.cat([part(0, (2, 4 + i), torch.float32), part(1, (2, 4 + i), torch.float32)], dim=-1)
        assert torch.equal(native[0][("gather-run", i)], expected), i
