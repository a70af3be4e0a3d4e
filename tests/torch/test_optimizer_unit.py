"""DistributedOptimizer and the broadcast functions, without processes.

One process: ``dp_plugin.torch`` runs on the local engine (world size 1).
Several ranks: a thread group of fake engines (``tests.unit.fakes``) handed
to the optimizer through a process set, one thread per rank.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.api import process_sets
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import DPPluginError, LayoutMismatchError
from dp_plugin.torch.optimizer import _DistributedOptimizer
from dp_plugin.torch.optimizer_state import JoinFlags
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture
from tests.unit.fakes import make_thread_group, run_ranks, run_ranks_outcomes


class ThreadSet(process_sets.ProcessSet):
    """A process set whose engine is one thread-rank of a fake group."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(list(range(engine.size)))
        self.process_set_id = 99
        self._engine = engine


def on_ranks(n: int, fn: Callable[[int, ThreadSet], Any]) -> list[Any]:
    return run_ranks(make_thread_group(n), lambda e: fn(e.rank, ThreadSet(e)))


def errors_on_ranks(n: int, fn: Callable[[int, ThreadSet], Any]) -> list[BaseException]:
    outcomes = run_ranks_outcomes(make_thread_group(n), lambda e: fn(e.rank, ThreadSet(e)),
                                  timeout=30)
    assert all(isinstance(o, BaseException) for o in outcomes), outcomes
    return outcomes


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def backward(model: nn.Module, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(5, 3, generator=g)).pow(2).sum().backward()


# -- the wrapper is the user's optimizer ---------------------------------------------


def test_wrapper_is_an_instance_of_the_users_class_with_the_wrapper_first() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert type(opt).__name__ == "DistributedSGD"
    mro = type(opt).__mro__  # the one wrapper class, then the user's class
    assert mro[1:mro.index(torch.optim.SGD)] == (_DistributedOptimizer,)
    again = hvd.DistributedOptimizer(torch.optim.SGD(linear_model().parameters(), lr=0.1))
    assert type(again) is type(opt)  # one class per optimizer class
    adam = hvd.DistributedOptimizer(torch.optim.Adam(linear_model().parameters()))
    assert isinstance(adam, torch.optim.Adam) and not isinstance(adam, torch.optim.SGD)


def test_wrapper_shares_param_groups_and_keeps_hyper_parameters() -> None:
    model = linear_model()
    base = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5, weight_decay=1e-3)
    opt = hvd.DistributedOptimizer(base)
    assert opt.param_groups is base.param_groups
    assert opt.defaults == base.defaults
    assert opt.param_groups[0]["momentum"] == 0.5


def test_one_rank_steps_exactly_like_the_plain_optimizer() -> None:
    model, reference = linear_model(), linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   compression=hvd.Compression.fp16,
                                   gradient_predivide_factor=2.0)
    ref = torch.optim.Adam(reference.parameters(), lr=0.1)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            backward(m, step)
            o.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_round_trip_and_load_into_a_new_wrapper() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05))
    for step in range(2):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    saved = opt.state_dict()
    fresh = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.9))
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert loaded["param_groups"][0]["lr"] == 0.05
    for key, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(loaded["state"][key][name], value)


def test_load_state_dict_keeps_sharing_groups_and_state_with_the_plain_optimizer() -> None:
    """torch's load_state_dict rebinds param_groups and state; an LR scheduler
    built on the plain optimizer must still steer the wrapper afterwards."""
    model = linear_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base)
    opt.zero_grad()
    backward(model)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is base.param_groups and opt.state is base.state
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05
    assert all("momentum_buffer" in base.state[p] for p in model.parameters())


def test_step_hooks_of_the_users_optimizer_run_once_per_step() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    backward(model)
    opt.step()
    assert calls == ["pre", "post"]


def test_lr_scheduler_and_closure_work() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()"
        assert isinstance(opt.step(closure), torch.Tensor)
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5

    other = linear_model()
    lbfgs = hvd.DistributedOptimizer(torch.optim.LBFGS(other.parameters(), max_iter=3))

    def lbfgs_closure() -> torch.Tensor:
        lbfgs.zero_grad()  # each call is synchronized, so zero_grad is allowed here
        loss = other(torch.ones(2, 3)).pow(2).sum()
        loss.backward()
        return loss

    lbfgs.step(lbfgs_closure)


# -- misuse gets Horovod's errors ---------------------------------------------------------


def test_zero_grad_between_backward_and_step_is_a_race_error() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    backward(model)
    with pytest.raises(AssertionError, match="race condition") as info:
        opt.zero_grad()
    assert isinstance(info.value, DPPluginError)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()  # fine once synchronized
    backward(model)
    with pytest.raises(AssertionError, match="load_state_dict"):
        opt.load_state_dict(opt.state_dict())
    opt.step()
    opt.zero_grad()


def test_named_parameters_are_validated() -> None:
    model = linear_model()
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"must be unique\. Found duplicates: w"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for _, p in params])
    with pytest.raises(ValueError, match=r"not named: param_groups\[0\]\['params'\]\[3\] "
                                         r"\(shape \(2,\)\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=params[:3])
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[p for _, p in params])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"op": hvd.Adasum}, NotImplementedError, "Adasum is not supported"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError, "only supported with"),
        ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be"),
        ({"compression": "zip"}, ValueError, "hvd.Compression.fp16"),
        ({"groups": 0}, ValueError, "groups should be"),
        ({"groups": [["not a tensor"]]}, ValueError, "groups must consist of torch.Tensor"),
        ({"process_set": [0, 1]}, TypeError, "expects an hvd.ProcessSet"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(linear_model().parameters(), lr=0.1), **kwargs)


def test_wrapping_twice_or_wrapping_a_non_optimizer_is_refused() -> None:
    opt = hvd.DistributedOptimizer(torch.optim.SGD(linear_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(TypeError, match=r"expects a torch\.optim\.Optimizer"):
        hvd.DistributedOptimizer(linear_model())


def test_add_param_group_without_a_name_is_refused_and_rolled_back() -> None:
    model, extra = linear_model(), nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(2, 2\)\)"):
        opt.add_param_group({"params": extra.parameters()})
    assert len(opt.param_groups) == 1
    backward(model)
    opt.step()  # still works


def test_optimizer_over_named_parameters_keeps_working() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.named_parameters(), lr=0.1))
    backward(model)
    opt.step()
    assert opt.param_groups[0]["param_names"][0] == "0.weight"


def test_groups_and_num_groups_are_accepted() -> None:
    model = linear_model()
    params = list(model.parameters())
    hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=[params[:2]])
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), num_groups=2)


def test_use_before_init_names_init() -> None:
    hvd.shutdown()
    with pytest.raises(hvd.NotInitializedError, match=r"hvd.init\(\)") as info:
        hvd.DistributedOptimizer(torch.optim.SGD(linear_model().parameters(), lr=0.1))
    assert isinstance(info.value, ValueError)  # Horovod raises ValueError here
    with pytest.raises(ValueError, match="initialized"):
        hvd.broadcast_parameters(linear_model().state_dict(), 0)


def test_skip_synchronize_and_the_double_synchronize_warning() -> None:
    model = linear_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    backward(model)
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()
    backward(model)
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


# -- several ranks -------------------------------------------------------------------------


def _param_model(rank: int) -> tuple[nn.ParameterDict, torch.Tensor]:
    """Parameters a, b, unused; the gradient of a is (rank+1)*ones, of b rank*arange."""
    torch.manual_seed(0)
    params = nn.ParameterDict({
        "a": nn.Parameter(torch.zeros(3, 2)),
        "b": nn.Parameter(torch.zeros(5, dtype=torch.float64)),
        "unused": nn.Parameter(torch.zeros(4)),
    })
    weights = torch.arange(5, dtype=torch.float64) * rank
    return params, weights


def _loss(params: nn.ParameterDict, weights: torch.Tensor, rank: int) -> torch.Tensor:
    return (params["a"] * (rank + 1)).sum() + (params["b"] * weights).sum()


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_are_averaged_and_missing_ones_are_zeros(n: int) -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       named_parameters=params.named_parameters(),
                                       process_set=ps)
        for _ in range(3):
            opt.zero_grad()
            _loss(params, weights, rank).backward()
            opt.synchronize()
            mean = sum(r + 1 for r in range(n)) / n
            assert torch.equal(params["a"].grad, torch.full((3, 2), mean))
            expected_b = torch.arange(5, dtype=torch.float64) * sum(range(n)) / n
            assert torch.allclose(params["b"].grad, expected_b)
            assert params["unused"].grad is not None
            assert torch.equal(params["unused"].grad, torch.zeros(4))
            with opt.skip_synchronize():
                opt.step()

    on_ranks(n, body)


def test_registered_comm_hook_reduces_every_bucket() -> None:
    """A user's hook replaces the default all-reduce; wrapping composes policies."""
    from dp_plugin.reduce.hooks import allreduce_hook, compression_wrapper

    calls: list[tuple[int, str]] = []

    def counting(state: Any, bucket: Any) -> Any:
        calls.append((bucket.index, bucket.dtype))
        return allreduce_hook(state, bucket)

    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       named_parameters=params.named_parameters(),
                                       process_set=ps)
        opt.register_comm_hook(compression_wrapper(counting, "bf16"))
        opt.zero_grad()
        _loss(params, weights, rank).backward()
        opt.synchronize()
        with pytest.raises(TypeError, match="callable hook"):
            opt.register_comm_hook("allreduce")  # type: ignore[arg-type]
        return params["a"].grad.clone()

    grads = on_ranks(2, body)
    assert all(torch.equal(g, torch.full((3, 2), 1.5)) for g in grads)  # exact in bf16
    assert calls and {dtype for _, dtype in calls} <= {"bfloat16"}  # the wrapper narrowed


def test_parameter_used_on_one_rank_only_gets_the_average_everywhere() -> None:
    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       named_parameters=params.named_parameters(),
                                       process_set=ps)
        loss = _loss(params, weights, rank)
        if rank == 1:
            loss = loss + (params["unused"] * 4.0).sum()
        loss.backward()
        opt.synchronize()
        return params["unused"].grad.clone()

    grads = on_ranks(2, body)
    assert all(torch.equal(g, torch.full((4,), 2.0)) for g in grads)


@pytest.mark.parametrize(
    ("kwargs", "scale", "atol"),
    [
        ({"op": hvd.Sum}, 2.0, 0.0),
        ({"gradient_predivide_factor": 4.0}, 1.0, 0.0),
        ({"compression": hvd.Compression.fp16}, 1.0, 1e-3),
        ({"compression": hvd.Compression.bf16}, 1.0, 1e-2),
    ],
)
def test_op_predivide_and_compression(kwargs: dict[str, Any], scale: float, atol: float) -> None:
    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       process_set=ps, **kwargs)
        _loss(params, weights, rank).backward()
        opt.synchronize()
        return params["a"].grad.clone()

    for grad in on_ranks(2, body):
        assert torch.allclose(grad, torch.full((3, 2), 1.5 * scale), atol=atol)


def test_backward_passes_per_step_accumulates_locally() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       process_set=ps, backward_passes_per_step=2)
        assert opt.backward_passes_per_step == 2
        for _ in range(2):
            _loss(params, weights, rank).backward()
        opt.synchronize()
        assert torch.equal(params["a"].grad, torch.full((3, 2), 3.0))  # 2 passes x mean 1.5
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        for _ in range(3):
            _loss(params, weights, rank).backward()

    errors = errors_on_ranks(2, body)
    assert all("more than backward_passes_per_step times" in str(e) for e in errors), errors


def test_add_param_group_after_wrapping_reduces_the_new_parameters() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD([params["a"]], lr=1.0), process_set=ps)
        opt.add_param_group({"params": [params["b"]], "lr": 0.5})
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5
        _loss(params, weights, rank).backward()
        opt.synchronize()
        assert torch.allclose(params["b"].grad, torch.arange(5, dtype=torch.float64) * 0.5)

    on_ranks(2, body)


def test_sparse_gradients_reduce_alike_with_and_without_sparse_as_dense() -> None:
    def make(rank: int, ps: ThreadSet, dense: bool) -> tuple[nn.Embedding, Any]:
        torch.manual_seed(0)
        emb = nn.Embedding(6, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       process_set=ps, sparse_as_dense=dense)
        return emb, opt

    def run(rank: int, ps: ThreadSet, dense: bool) -> list[torch.Tensor]:
        emb, opt = make(rank, ps, dense)
        grads = []
        for step in range(3):  # step 1 re-plans the buckets without the table
            opt.zero_grad()
            emb(torch.tensor([rank, 2 + step])).sum().backward()
            opt.synchronize()
            assert emb.weight.grad.is_sparse
            grads.append(emb.weight.grad.to_dense())
            with opt.skip_synchronize():
                opt.step()
        return grads

    for dense in (False, True):
        results = on_ranks(2, lambda rank, ps, dense=dense: run(rank, ps, dense))
        for step, grad in enumerate(results[0]):
            expected = torch.zeros(6, 2)
            expected[:2] = 0.5
            expected[2 + step] += 1.0  # both ranks looked it up: average of 1 and 1
            assert torch.equal(grad, expected), (dense, step, grad)
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))


def test_sparse_gradients_refuse_min_max() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        emb = nn.Embedding(4, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       process_set=ps, op=hvd.Max)
        emb(torch.tensor([rank])).sum().backward()
        opt.synchronize()

    errors = errors_on_ranks(2, body)
    assert all("cannot reduce sparse" in str(e) for e in errors), errors


def test_ranks_that_differ_in_sparse_embeddings_get_a_layout_error_at_the_wrap() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        emb = nn.Embedding(4, 2, sparse=rank == 1)
        hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), process_set=ps,
                                 named_parameters=emb.named_parameters())

    errors = errors_on_ranks(2, body)
    assert all(isinstance(e, LayoutMismatchError) and "'weight'" in str(e) for e in errors), \
        errors


def test_a_sparse_gradient_for_a_parameter_wrapped_as_dense_raises_on_every_rank() -> None:
    def body(rank: int, ps: ThreadSet) -> tuple[str, torch.Tensor]:
        torch.manual_seed(0)
        table = nn.Parameter(torch.randn(4, 2))  # no sparse module: wrapped as dense
        opt = hvd.DistributedOptimizer(torch.optim.SGD([table], lr=1.0), process_set=ps,
                                       named_parameters=[("table", table)])
        ids = torch.tensor([rank])
        nn.functional.embedding(ids, table, sparse=rank == 1).sum().backward()
        with pytest.raises(DPPluginError) as raised:
            opt.synchronize()
        opt.zero_grad()  # the step was dropped: the next one works
        nn.functional.embedding(ids, table).sum().backward()
        opt.synchronize()
        return str(raised.value), table.grad

    (theirs, grad0), (mine, grad1) = on_ranks(2, body)
    assert theirs.startswith("a parameter (named in that rank's error) on rank 1 has a sparse")
    assert mine.startswith("parameter 'table' on rank 1 has a sparse gradient")
    assert "sparse_as_dense=True" in mine
    expected = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(grad0, expected) and torch.equal(grad1, expected)


def test_a_dense_gradient_of_a_sparse_parameter_is_averaged_and_stays_dense() -> None:
    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        emb = nn.Embedding(3, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       process_set=ps)
        if rank == 0:  # e.g. a table tied to a dense layer
            (emb.weight.sum() * 2).backward()
        else:
            emb(torch.tensor([1])).sum().backward()
        opt.synchronize()
        assert emb.weight.grad.is_sparse == (rank == 1)
        return emb.weight.grad.to_dense()

    grads = on_ranks(2, body)
    assert torch.equal(grads[0], torch.tensor([[1.0, 1.0], [1.5, 1.5], [1.0, 1.0]]))
    assert torch.equal(grads[0], grads[1])


def test_ranks_with_different_models_get_a_layout_error_not_a_hang() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        model = nn.Linear(3, 2 + rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       process_set=ps)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()

    errors = errors_on_ranks(2, body)
    assert all("'weight' shape (2, 3)" in str(e) for e in errors), errors


def test_timeline_records_the_optimizers_buckets(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    hvd.start_timeline(str(path), mark_cycles=True)

    def body(rank: int, ps: ThreadSet) -> None:
        params, weights = _param_model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=1.0),
                                       process_set=ps)
        _loss(params, weights, rank).backward()
        opt.step()

    on_ranks(2, body)
    hvd.stop_timeline()
    events = json.loads((tmp_path / "trace.rank0.json").read_text())
    names = {e["name"] for e in events}
    assert any(n.startswith("allreduce") for n in names), names
    assert "CYCLE_START" in names


# -- broadcasts ------------------------------------------------------------------------------


def test_broadcast_parameters_and_optimizer_state_from_the_root() -> None:
    def body(rank: int, ps: ThreadSet) -> tuple[torch.Tensor, dict[str, Any]]:
        model = linear_model(seed=rank)
        extra = {
            "flag": torch.tensor([rank % 2 == 0, True]),
            "complex": torch.full((2,), complex(rank, -rank)),
            "strided": torch.full((3, 4), float(rank)).t(),
        }
        opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1),
                               betas=(0.8, 0.9 + 0.01 * rank))
        if rank == 1:  # only the root has state (e.g. it loaded a checkpoint)
            backward(model)
            opt.step()
        hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=ps)
        hvd.broadcast_parameters(list(extra.items()), root_rank=1, process_set=ps)
        hvd.broadcast_optimizer_state(opt, root_rank=1, process_set=ps)
        assert torch.equal(extra["flag"], torch.tensor([False, True]))
        assert torch.equal(extra["complex"], torch.full((2,), complex(1, -1)))
        assert torch.equal(extra["strided"], torch.ones(4, 3))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return flat, opt.state_dict()

    (flat0, state0), (flat1, state1) = on_ranks(2, body)
    assert torch.equal(flat0, flat1)
    assert state0["param_groups"] == state1["param_groups"]
    assert state0["param_groups"][0]["lr"] == pytest.approx(0.2)
    assert state0["param_groups"][0]["betas"] == (0.8, 0.91)
    for key, state in state1["state"].items():
        for name, value in state.items():
            assert torch.equal(state0["state"][key][name], value), (key, name)


def test_broadcast_optimizer_state_without_state_leaves_parameters_alone() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        model = linear_model(seed=0)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=0.1 + rank, weight_decay=0.5)
        hvd.broadcast_optimizer_state(opt, root_rank=0, process_set=ps)
        assert opt.param_groups[0]["lr"] == 0.1
        assert len(opt.state) == 0
        for a, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(a, b)

    on_ranks(2, body)


def test_broadcast_object_and_allgather_object() -> None:
    def body(rank: int, ps: ThreadSet) -> tuple[Any, list[Any]]:
        obj = hvd.broadcast_object({"rank": rank, "f": lambda x: x + rank}, root_rank=1,
                                   process_set=ps)
        return obj["f"](10), hvd.allgather_object(("r", rank), process_set=ps)

    for value, gathered in on_ranks(3, body):
        assert value == 11
        assert gathered == [("r", 0), ("r", 1), ("r", 2)]


def test_rooted_functions_take_job_wide_roots_in_a_set_of_ranks_1_and_2() -> None:
    """Horovod's rule: root_rank is a job-wide rank, also in a process set whose
    members are not 0..k-1 (here job ranks 1 and 2 of 3, as thread-ranks 0, 1)."""

    def body(rank: int, ps: ThreadSet) -> list[Any]:
        ps.ranks = [1, 2]
        ps.included = lambda: True  # type: ignore[method-assign]  # thread-ranks 0, 1
        ps.engine().global_ranks = (1, 2)
        job_rank = rank + 1
        model = linear_model(seed=job_rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        backward(model, job_rank)
        opt.step()  # momentum buffers that differ per rank
        hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)
        hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=ps)
        obj = hvd.broadcast_object({"from": job_rank}, root_rank=2, process_set=ps)
        t = hvd.broadcast(torch.full((2,), float(job_rank)), root_rank=1, process_set=ps)
        errors = []
        for fn in (
            lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=ps),
            lambda: hvd.broadcast_optimizer_state(opt, root_rank=0, process_set=ps),
            lambda: hvd.broadcast_object(1, root_rank=0, process_set=ps),
            lambda: hvd.broadcast(torch.ones(2), root_rank=0, process_set=ps),
        ):
            with pytest.raises(ValueError, match=r"not .*process set") as info:
                fn()
            errors.append(str(info.value))
        momentum = [v["momentum_buffer"] for v in opt.state_dict()["state"].values()]
        return [model.state_dict(), momentum, obj, t, errors]

    results = on_ranks(2, body)
    reference = linear_model(seed=2).state_dict()
    for state, momentum, obj, t, errors in results:
        # The root's weights arrived everywhere (it stepped: compare with rank 1's copy).
        assert all(torch.equal(state[k], results[1][0][k]) for k in reference)
        assert all(torch.equal(a, b) for a, b in zip(momentum, results[1][1], strict=True))
        assert obj == {"from": 2}
        assert torch.equal(t, torch.full((2,), 1.0))
        assert len(errors) == 4 and all("0" in e for e in errors)


def test_broadcast_parameters_mismatch_and_bad_input() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        hvd.broadcast_parameters(nn.Linear(2, 2 + rank).state_dict(), 0, process_set=ps)

    errors = errors_on_ranks(2, body)
    assert all("differ across ranks" in str(e) for e in errors), errors
    with pytest.raises(ValueError, match="not a single tensor"):
        hvd.broadcast_parameters(torch.ones(2), 0)
    with pytest.raises(ValueError, match="root_rank 3 is not a rank of the process set"):
        hvd.broadcast_parameters(linear_model().state_dict(), 3)
    with pytest.raises(ValueError, match=r"not a torch\.Tensor"):
        hvd.broadcast_parameters([("x", 1.0)], 0)


def test_one_rank_broadcasts_are_no_ops() -> None:
    model = linear_model()
    before = model.state_dict()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert hvd.broadcast_object([1, 2]) == [1, 2]
    assert hvd.allgather_object("x") == ["x"]


# -- join flags ----------------------------------------------------------------------------


class _ControlSlot:
    """The part of a reducer that JoinFlags uses: its engine's ranks, a flag group."""

    def __init__(self, n: int, rank: int) -> None:
        self.slot = torch.zeros(n)
        self.engine = SimpleNamespace(global_ranks=list(range(n)), rank=rank)

    def flags_of(self, name: str, like: Any = None) -> torch.Tensor:
        return self.slot


@pytest.mark.parametrize("op", list(ReduceOp))
def test_join_flags_decode_every_op(op: ReduceOp) -> None:
    """Simulate the reduction of the control slots of 3 ranks, rank 2 joined."""
    slots = [_ControlSlot(3, r) for r in range(3)]
    flags = [JoinFlags(slots[r], op=op, like=torch.ones(1)) for r in range(3)]
    # The control slot travels unscaled, with the engine's op (a sum for average),
    # possibly compressed to fp16.
    combine = {
        ReduceOp.SUM: lambda t: t.sum(0), ReduceOp.MAX: lambda t: t.amax(0),
        ReduceOp.MIN: lambda t: t.amin(0), ReduceOp.PRODUCT: lambda t: t.prod(0),
        ReduceOp.AVERAGE: lambda t: t.to(torch.float16).float().sum(0),
    }[op]

    def reduce() -> None:
        reduced = combine(torch.stack([s.slot.clone() for s in slots]))
        for s in slots:
            s.slot.copy_(reduced)

    flags[2].fill(joined=True)
    reduce()
    assert flags[0].decide() == (False, -1)
    for f in flags:
        f.fill(joined=True)
    reduce()
    assert flags[0].decide() == (True, 1)  # ranks 0 and 1 joined last; the highest wins
    assert slots[0].slot.tolist() == [flags[0]._code.idle] * 3  # reset for the next step


def test_unnamed_parameters_get_horovods_names() -> None:
    """Horovod's rule: ``allreduce.noname.<group>.<index>``, in ``_parameter_names``,
    also when torch keeps ``param_names`` (Horovod 0.28.1 ignores them)."""
    model, extra = linear_model(), nn.Linear(2, 2)
    params = list(model.parameters())
    sgd = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    opt = hvd.DistributedOptimizer(sgd)
    names = opt._parameter_names
    assert [names[p] for p in params] == ["allreduce.noname.0.0"] + [
        f"allreduce.noname.1.{j}" for j in range(len(params) - 1)]
    opt.add_param_group({"params": extra.parameters()})
    assert opt._parameter_names[extra.weight] == "allreduce.noname.2.0"
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.named_parameters(), lr=0.1))
    assert named._parameter_names[params[0]] == "allreduce.noname.0.0"
    assert named._compression is hvd.Compression.none
    given = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16)
    assert given._parameter_names[params[0]] == "0.weight"
    assert given._compression is hvd.Compression.fp16
    backward(model)
    given.step()
