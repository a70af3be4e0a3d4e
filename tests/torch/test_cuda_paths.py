"""CUDA code paths of dp_plugin.torch; every test is skipped without a GPU.

In this process, world size 1 under torchrun-style variables with
``DP_PLUGIN_ENGINE=nccl`` (NCCL runs even with one rank, so the device
paths are exercised for real):
- ``hvd.allreduce`` on CUDA tensors (ops, scale factors, autograd);
- ``GradientScheduler`` packing CUDA gradients into device fusion buffers
  reduced by NCCL;
- ``DistributedOptimizer`` training a CUDA model (with one rank it leaves
  gradients alone, as Horovod does) against a plain optimizer;
- ``SyncBatchNorm`` on CUDA: the module (one rank: plain batch norm) and
  its synchronized function over the NCCL engine and over a host-only
  engine (statistics staged through the CPU), against ``F.batch_norm``.

With real processes (this file is also the worker, see ``worker_main``):
two ranks sharing one GPU with the gloo engine on CUDA tensors (also the
sharded optimizer's and PowerSGD's multi-process workers with CUDA models),
and, with two or more GPUs, two ranks with NCCL: parameters must end identical on
both ranks and equal to a single-process run on the global batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dp_plugin.config import Config
from dp_plugin.engines.local import LocalEngine
from dp_plugin.launch.launchers import Topology

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available())"),
]
TOL = 1e-5


@pytest.fixture
def nccl_one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``hvd.init()`` as one torchrun rank on the NCCL engine; shut down after."""
    import dp_plugin.torch as hvd
    from tests.multiproc.harness import free_port, launcher_variables

    for name in launcher_variables():
        monkeypatch.delenv(name)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port()), "DP_PLUGIN_ENGINE": "nccl",
                        "DP_PLUGIN_TIMEOUT": "60"}.items():
        monkeypatch.setenv(name, value)
    hvd.init()
    try:
        from dp_plugin.launch import runtime

        assert runtime.engine().name == "nccl"
        torch.cuda.set_device(hvd.local_rank())
        yield hvd
    finally:
        hvd.shutdown()


def test_allreduce_cuda_tensor(nccl_one_rank: Any) -> None:
    hvd = nccl_one_rank
    x = torch.arange(6, dtype=torch.float32, device="cuda").view(2, 3)
    for op in (hvd.Average, hvd.Sum, hvd.Max):
        out = hvd.allreduce(x, op=op, name=f"cuda.{op}")
        assert out.device.type == "cuda"
        torch.testing.assert_close(out, x)  # one rank: every op is the identity
        assert out.data_ptr() != x.data_ptr()
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    torch.testing.assert_close(scaled, x * 0.5)
    half = hvd.allreduce(x.half(), op=hvd.Sum)
    assert half.dtype == torch.float16 and half.device.type == "cuda"
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Sum)
    torch.testing.assert_close(y, x)

    leaf = x.clone().requires_grad_(True)
    hvd.allreduce(leaf, op=hvd.Sum).pow(2).sum().backward()
    assert leaf.grad is not None and leaf.grad.device.type == "cuda"
    torch.testing.assert_close(leaf.grad, 2 * x)


def test_nccl_stages_cpu_buffers(nccl_one_rank: Any) -> None:
    """CPU tensors and numpy buffers under nccl are copied to the
    GPU, moved there and copied back (Horovod's ``metric_average`` pattern)."""
    import numpy as np

    from dp_plugin.launch import runtime

    hvd = nccl_one_rank
    eng = runtime.engine()
    x = torch.arange(4.0)
    eng.allreduce_async(x, "sum", name="cpu.sum").wait()
    assert x.device.type == "cpu" and torch.equal(x, torch.arange(4.0))
    a = np.arange(3, dtype=np.float32)
    eng.allreduce_async(a, "sum", name="numpy.sum").wait()
    assert np.array_equal(a, np.arange(3, dtype=np.float32))
    rows = eng.allgather(torch.ones(2, 3), [2], name="cpu.gather")
    assert rows.device.type == "cpu" and rows.shape == (2, 3)
    eng.broadcast(x, 0, name="cpu.bcast")
    hvd.barrier()
    out = hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum)
    assert out.device.type == "cpu" and out.item() == 2.0


def test_scheduler_reduces_cuda_buffers(nccl_one_rank: Any) -> None:
    from dp_plugin.launch import runtime
    from dp_plugin.reduce.fusion import TensorSpec
    from dp_plugin.reduce.reducer import GradientScheduler

    grads = [torch.full(shape, float(i + 1), device="cuda", dtype=dtype)
             for i, (shape, dtype) in enumerate([((4, 3), torch.float32), ((5,), torch.float32),
                                                 ((2, 2), torch.float16), ((7,), torch.float32)])]
    expected = [g.clone() for g in grads]
    specs = [TensorSpec.of(f"g{i}", g) for i, g in enumerate(grads)]
    sched = GradientScheduler(specs, engine=runtime.engine(), op="average", fusion_threshold=32)
    for step in range(3):  # step 0 checks the layout; later steps reuse the buffers
        for i in reversed(range(len(grads))):
            sched.mark_ready(i, grads[i])
        out = sched.synchronize()
        for i, (o, e) in enumerate(zip(out, expected, strict=True)):
            assert o.device.type == "cuda", f"step {step} tensor {i}"
            torch.testing.assert_close(o, e)
    sched.close()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_distributed_optimizer_cuda_model(nccl_one_rank: Any) -> None:
    hvd = nccl_one_rank
    model, reference = _mlp(0).cuda(), _mlp(0).cuda()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 8, generator=g).cuda(), torch.randn(6, 4, generator=g).cuda()
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p, q, rtol=0, atol=TOL)


def test_sync_batch_norm_module_cuda(nccl_one_rank: Any) -> None:
    hvd = nccl_one_rank
    sync, ref = hvd.SyncBatchNorm(3).cuda(), nn.BatchNorm2d(3).cuda()
    x = torch.randn(4, 3, 5, 5, device="cuda") * 2 + 1
    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    sync(xs).square().sum().backward()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(sync.running_var, ref.running_var)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(x), ref(x))


class _HostOnlyEngine(LocalEngine):
    """One rank whose collectives take host buffers only, like the gloo, mpi
    and horovod engines' host paths: SyncBatchNorm must stage its CUDA
    statistics through the CPU for it."""

    name = "host-only"

    def __init__(self) -> None:
        super().__init__(Topology(launcher="torchrun", rank=0, size=1, local_rank=0,
                                  local_size=1, cross_rank=0, cross_size=1), Config())

    def _allreduce_async(self, buf: Any, op: Any, name: str) -> Any:
        assert buf.device.type == "cpu", f"{name}: got a {buf.device} buffer"
        return super()._allreduce_async(buf, op, name)


@pytest.mark.parametrize("engine_kind", ["nccl", "host-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sync_batch_norm_function_cuda(nccl_one_rank: Any, engine_kind: str,
                                       dtype: torch.dtype) -> None:
    """The synchronized path (used with 2+ ranks) run with one rank on CUDA."""
    from dp_plugin.launch import runtime
    from dp_plugin.torch.sync_batch_norm import _SyncBatchNormFunction

    engine = runtime.engine() if engine_kind == "nccl" else _HostOnlyEngine()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 4, 3, 3, generator=g) * 3 + 2).cuda().to(dtype)
    weight = (torch.rand(4, generator=g) + 0.5).cuda().requires_grad_(True)
    bias = torch.randn(4, generator=g).cuda().requires_grad_(True)
    r = torch.randn(6, 4, 3, 3, generator=g).cuda()
    stats = [torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")]
    ref_stats = [s.clone() for s in stats]

    xs = x.clone().requires_grad_(True)
    out = _SyncBatchNormFunction.apply(xs, weight, bias, *stats, 1e-5, 0.1, engine)
    assert out.dtype == dtype and out.device.type == "cuda"
    (out.float() * r).sum().backward()
    sync_grads = (xs.grad, weight.grad.clone(), bias.grad.clone())
    weight.grad = bias.grad = None

    xr = x.float().clone().requires_grad_(True)
    ref = F.batch_norm(xr, *ref_stats, weight, bias, True, 0.1, 1e-5)
    (ref * r).sum().backward()
    tol = TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(sync_grads[0].float(), xr.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(sync_grads[1], weight.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(sync_grads[2], bias.grad, rtol=tol, atol=tol)
    for s, rs in zip(stats, ref_stats, strict=True):
        torch.testing.assert_close(s, rs, rtol=tol, atol=tol)


# -- real processes: two ranks on CUDA tensors ------------------------------------

PER_RANK, STEPS = 4, 3


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", ["gloo", "nccl"])
def test_two_ranks_train_cuda_model(engine: str) -> None:
    from tests.multiproc.harness import assert_ranks_ok, run_workers

    if engine == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank; this machine has 1")
    result = run_workers("env", 2, Path(__file__), args=["--worker"],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60"},
                         timeout=180)
    assert_ranks_ok(result, 2)


WORKERS = Path(__file__).parents[1] / "multiproc" / "workers"


@pytest.mark.multiproc
@pytest.mark.parametrize(("worker", "case"), [
    ("torch_sharded.py", "optimizers"), ("torch_sharded.py", "options"),
    ("torch_sharded.py", "checkpoint"), ("torch_sharded.py", "join"),
    ("torch_powersgd.py", "reference"), ("torch_powersgd.py", "accumulation"),
    ("torch_powersgd.py", "join")])
def test_two_ranks_on_one_gpu(worker: str, case: str) -> None:
    """The sharded optimizer (bitwise equal to the unsharded one, SGD-momentum,
    Adam, AdamW, options, checkpoints, join) and PowerSGD (against the CPU
    reference of its algorithm) with CUDA models: both ranks on cuda:0, gloo."""
    from tests.multiproc.harness import assert_ranks_ok, run_workers

    result = run_workers("env", 2, WORKERS / worker, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60",
                              "DP_TEST_DEVICE": "cuda"}, timeout=240)
    assert_ranks_ok(result, 2)


def worker_main() -> None:
    """Two ranks (gloo: both on cuda:0; nccl: cuda:local_rank) train a
    CUDA model with SyncBatchNorm and DistributedOptimizer; parameters must
    match across ranks and a single-process run on the global batch."""
    import dp_plugin.torch as hvd

    rank = "?"
    try:
        hvd.init()
        rank = str(hvd.rank())
        n_dev = torch.cuda.device_count()
        device = torch.device("cuda", hvd.local_rank() % n_dev)
        torch.cuda.set_device(device)

        def build(seed: int, bn: type[nn.Module]) -> nn.Module:
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(8, 16), bn(16), nn.ReLU(), nn.Linear(16, 4)).to(device)

        model = build(10 + hvd.rank(), hvd.SyncBatchNorm)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        reference = build(10, nn.BatchNorm1d)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        size, me = hvd.size(), hvd.rank()
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(size * PER_RANK, 8, generator=g).to(device)
            y = torch.randn(size * PER_RANK, 4, generator=g).to(device)
            mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
            opt.zero_grad()
            # Sum over the shard / global count: the averaged gradients are
            # then exactly the global batch's (SyncBatchNorm couples the rows).
            (F.mse_loss(model(x[mine]), y[mine], reduction="sum") * size / y.numel()).backward()
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(reference(x), y, reduction="sum").div(y.numel()).backward()
            ref_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        ref_flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).cpu()
        everyone = hvd.allgather_object(flat)
        if not all(torch.equal(t, everyone[0]) for t in everyone):
            raise AssertionError("parameters differ between ranks")
        err = (flat - ref_flat).abs().max().item()
        if not err <= TOL:
            raise AssertionError(f"parameters differ from the single-process run by {err:.3g}")
        hvd.shutdown()
    except BaseException:
        print(f"rank {rank} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", required=True)
    parser.parse_args()
    worker_main()
