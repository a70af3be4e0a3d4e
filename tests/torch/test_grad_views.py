"""DistributedOptimizer keeps gradients as views of the fusion buffer
(DDP's ``gradient_as_bucket_view``, ``Config.gradient_as_bucket_view``):
results bitwise equal to the copying path, no buffer allocated per step once
warm, and the cases where a gradient must stay a tensor of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture
from tests.torch.test_optimizer_unit import ThreadSet, backward, linear_model
from tests.unit.fakes import make_thread_group, run_ranks


def on_ranks(n: int, fn: Callable[[int, ThreadSet], Any], views: bool = True,
             **settings: Any) -> list[Any]:
    config = Config(timeout_s=30.0, gradient_as_bucket_view=views, **settings)
    engines: list[Engine] = make_thread_group(n, config=config)
    return run_ranks(engines, lambda e: fn(e.rank, ThreadSet(e)))


def buffers(opt: Any) -> list[torch.Tensor]:
    return [b.flat for b in opt._dp.reducer.buckets if b.flat is not None]


def inside(grad: torch.Tensor, flats: list[torch.Tensor]) -> bool:
    if grad.is_sparse:
        return False
    start = grad.data_ptr()
    return any(f.data_ptr() <= start < f.data_ptr() + f.numel() * f.element_size()
               for f in flats)


def train(model: nn.Module, rank: int, ps: ThreadSet, steps: int,
          set_to_none: bool) -> dict[str, Any]:
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=ps)
    seen: list[Any] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        backward(model, rank + 10 * step)
        opt.step()
        flats = buffers(opt)
        seen.append(([id(f) for f in flats], [f.data_ptr() for f in flats],
                     [p.grad.data_ptr() for p in model.parameters()],
                     [inside(p.grad, flats) for p in model.parameters()]))
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters()], "seen": seen, "opt": opt}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_buffer_views_bitwise_equal_to_copies_and_stay_put(
        set_to_none: bool) -> None:
    steps = 5
    # Models are built before the threads start (torch's global seed is shared).
    models = [linear_model() for _ in range(4)]
    viewed = on_ranks(2, lambda r, ps: train(models[r], r, ps, steps, set_to_none))
    copied = on_ranks(2, lambda r, ps: train(models[2 + r], r, ps, steps, set_to_none),
                      views=False)
    for rank in range(2):
        for a, b in zip(viewed[rank]["params"] + viewed[rank]["grads"],
                        copied[rank]["params"] + copied[rank]["grads"], strict=True):
            assert torch.equal(a, b)
        seen = viewed[rank]["seen"]
        # From step 1 on (step 0 rebuilds the plan) every gradient lives in a
        # fusion buffer, and nothing moves or is re-allocated any more.
        assert all(all(flags) for *_, flags in seen[1:])
        assert all(s == seen[1] for s in seen[2:])
        assert not any(any(flags) for *_, flags in copied[rank]["seen"])
    assert torch.equal(viewed[0]["params"][0], viewed[1]["params"][0])  # ranks agree


def test_copies_take_turns_on_two_slabs_within_twice_the_threshold() -> None:
    """Without views, 6 buckets share two slabs of the threshold's size (at
    most two buckets in flight, the third waits): same bits as with views."""
    threshold = 96  # bytes: one Linear(4, 4) (64 + 16 bytes of gradients) per bucket

    def deep(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*(m for i in range(6) for m in (nn.Linear(4 - (i == 0), 4),
                                                              nn.Tanh())))

    def body(model: nn.Module, rank: int, ps: ThreadSet) -> dict[str, Any]:
        out = train(model, rank, ps, 3, set_to_none=True)
        reducer = out.pop("opt")._dp.reducer
        out["buckets"] = len(reducer.plan)
        out["slab bytes"] = reducer.slab_bytes()
        return out

    models = [deep(0) for _ in range(4)]
    settings = {"fusion_threshold": threshold, "first_bucket_threshold": None}
    viewed = on_ranks(2, lambda r, ps: body(models[r], r, ps), **settings)
    copied = on_ranks(2, lambda r, ps: body(models[2 + r], r, ps), views=False, **settings)
    for rank in range(2):
        for a, b in zip(viewed[rank]["params"] + viewed[rank]["grads"],
                        copied[rank]["params"] + copied[rank]["grads"], strict=True):
            assert torch.equal(a, b)
        assert copied[rank]["buckets"] == 6
        assert 0 < copied[rank]["slab bytes"] <= 2 * threshold
        assert viewed[rank]["slab bytes"] == 0  # views pin every buffer


def test_cases_where_a_gradient_stays_a_tensor_of_its_own() -> None:
    torch.manual_seed(0)
    modules = [(nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last), nn.Linear(3, 2),
                nn.Embedding(10, 3, sparse=True)) for _ in range(2)]

    def body(rank: int, ps: ThreadSet) -> list[list[bool]]:
        conv, lin, emb = modules[rank]
        params = [*conv.parameters(), *lin.parameters(), *emb.parameters()]
        g = torch.Generator().manual_seed(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), process_set=ps,
                                       sparse_as_dense=True)
        flags = []
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(1, 2, 5, 5, generator=g).to(memory_format=torch.channels_last)
            loss = conv(x).sum() + emb(torch.tensor([rank, 3])).sum() \
                + lin(torch.randn(4, 3, generator=g)).pow(2).sum()
            # create_graph (a gradient penalty): the gradients are part of a
            # graph, autograd replaces them out of place; no views.
            loss.backward(create_graph=step == 2)
            opt.step()
            flags.append([inside(p.grad, buffers(opt)) for p in params])
        return flags

    for flags in on_ranks(2, body):
        # conv weight: channels-last, not a flat slice; embedding: a sparse
        # gradient reduced as dense (its .grad is sparse again afterwards).
        assert flags[1] == [False, True, True, True, False]
        assert flags[2] == [False] * 5
