"""``PowerSGDHook`` in one process, on the one-rank engine: the hook's
arithmetic, on the CPU and (skipped without a GPU) on CUDA tensors.

With one rank the sums are the rank's own values, so after a compressed
step each gradient matrix is ``P Q^T`` with ``P`` the orthogonalized
``(M + e) Q`` and ``Q^T = P^T (M + e)``, and the error is what it left out;
the vectors come back unchanged. The multi-rank algorithm, against a
single-process reference, is tests/multiproc/test_torch_powersgd.py.
"""

from __future__ import annotations

import pytest
import torch

from dp_plugin.config import Config
from dp_plugin.engines.local import LocalEngine
from dp_plugin.launch.launchers import Topology
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.reducer import Reducer
from dp_plugin.torch.powersgd import PowerSGDHook, initial_q, orthogonalize_

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]
SHAPES = {"w1": (48, 20), "b1": (48,), "w2": (4, 48), "conv": (16, 3, 3, 3)}


def one_rank(hook: PowerSGDHook, device: str) -> Reducer:
    engine = LocalEngine(Topology(launcher="torchrun", rank=0, size=1, local_rank=0,
                                  local_size=1, cross_rank=0, cross_size=1), Config())
    where = str(torch.empty(0, device=device).device)  # "cuda" -> "cuda:0", as a tensor says
    specs = [TensorSpec(name, shape, "float32", where) for name, shape in SHAPES.items()]
    reducer = Reducer(specs, engine=engine, hook=hook, fusion_threshold=2048)
    hook.bind(reducer.state, engine.channel)
    return reducer


def expected(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's compressed matrix and its new ``Q`` (``m x r``)."""
    q = q.clone()
    orthogonalize_(q, 1e-8)
    p = m @ q
    orthogonalize_(p, 1e-8)
    new_q = m.mT @ p
    return p @ new_q.mT, new_q


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_compresses_with_error_feedback(device: str) -> None:
    hook = PowerSGDHook(rank=2, start_iter=1, seed=7)
    reducer = one_rank(hook, device)
    gen = torch.Generator().manual_seed(0)
    qs = {n: initial_q(n, 20, 2, 7) for n in ("w1",)}
    qs["conv"] = initial_q("conv", 27, 2, 7)
    errors = {n: torch.zeros(SHAPES[n][0], 27 if n == "conv" else 20) for n in qs}
    for step in range(3):
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        mine = [g.clone().to(device) for g in grads.values()]
        for i, g in enumerate(mine):
            reducer.mark_ready(i, g)
        out = dict(zip(SHAPES, (t.cpu() for t in reducer.synchronize()), strict=True))
        assert hook.step == step + 1
        for name in ("b1", "w2"):  # a vector, and 4 x 48 (not worth compressing at rank 2)
            assert torch.equal(out[name], grads[name])
        for name in qs:
            m = grads[name].reshape(SHAPES[name][0], -1)
            if step == 0:  # start_iter=1: the first step is exact
                assert torch.equal(out[name], grads[name])
                continue
            m = m + errors[name]
            approx, qs[name] = expected(m, qs[name])
            errors[name] = m - approx
            torch.testing.assert_close(out[name].reshape(m.shape), approx, rtol=1e-4,
                                       atol=1e-5)
            assert not torch.allclose(approx, m, atol=1e-3)  # it did compress
    assert hook.sent_numel > 0


class _Recording(LocalEngine):
    """The one-rank engine, recording which all-reduces have run their finishers
    (where an engine synchronizes with its library, releases a name or copies a
    staged result back)."""

    def __init__(self) -> None:
        super().__init__(Topology(launcher="torchrun", rank=0, size=1, local_rank=0,
                                  local_size=1, cross_rank=0, cross_size=1), Config())
        self.started: list[str] = []
        self.finished: list[str] = []

    def _allreduce_async(self, buf, op, name):  # type: ignore[no-untyped-def]
        self.started.append(name)
        return super()._allreduce_async(buf, op, name).then(lambda: self.finished.append(name))


class _Polled(PowerSGDHook):
    """Each bucket's handle found done by polling before anything waits for it
    (``hvd.poll``, or the optimizer looking at its buckets)."""

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        handle = super().__call__(state, bucket)
        while not handle.done():
            pass
        return handle


def test_a_compressed_bucket_found_done_by_polling_still_finishes_its_all_reduces() -> None:
    """Every all-reduce's own finishers run once its bucket is waited for,
    also when polling saw the bucket done first: the horovod engine releases
    a name's slot there, and a slot left taken on one rank gives its next use
    another name than on the others (a hang)."""
    engine = _Recording()
    hook = _Polled(rank=2, start_iter=0, seed=7)
    specs = [TensorSpec(name, shape, "float32", "cpu") for name, shape in SHAPES.items()]
    reducer = Reducer(specs, engine=engine, hook=hook, fusion_threshold=2048)
    hook.bind(reducer.state, lambda name: engine)  # as the horovod engine: one engine, no new group
    for _ in range(2):
        for i, shape in enumerate(SHAPES.values()):
            reducer.mark_ready(i, torch.ones(shape))
        reducer.synchronize()
    assert any(name.endswith(".powersgd.q") for name in engine.started)
    assert sorted(engine.finished) == sorted(engine.started)
