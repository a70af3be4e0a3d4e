"""Cross-rank agreement of fused layouts and settings (``dp_plugin.agree.check`` of a
``Request.fused``), on a fake thread group (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.agree.agreement import DIGEST_SIZE
from dp_plugin.agree.check import agreed_root, check
from dp_plugin.agree.check_messages import layout_text, settings_text
from dp_plugin.agree.edge import calling
from dp_plugin.agree.request import Request
from dp_plugin.errors import LayoutMismatchError, MismatchError, Problem
from dp_plugin.reduce.arrays import to_device, to_host
from dp_plugin.reduce.fusion import TensorSpec
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks, run_ranks_outcomes


def agree(engine: FakeEngine, specs: list[TensorSpec], what: str = "gradients",
          settings: dict[str, object] | None = None) -> None:
    check(engine, Request.fused(specs, what, settings))


def model(n: int = 4) -> list[TensorSpec]:
    return [TensorSpec(f"layer{i}.weight", (i + 1, 3), "float32") for i in range(n)]


def test_agreement_ignores_the_device_index_only() -> None:
    # One GPU per rank: 'cuda:0' on rank 0 and 'cuda:1' on rank 1 agree.
    def on(devices: list[str]) -> list[object]:
        def body(e: FakeEngine) -> None:
            agree(e, [TensorSpec("w", (2,), "float32", devices[e.rank])],
                  settings={"fusion threshold": 1024})

        return run_ranks_outcomes(make_thread_group(2), body)

    assert on(["cuda:0", "cuda:1"]) == [None, None]
    assert all(isinstance(o, LayoutMismatchError) for o in on(["cuda:0", "cpu"]))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_matching_layouts_pass(n: int) -> None:
    engines = make_thread_group(n)
    run_ranks(engines, lambda e: agree(e, model()))
    # One all-reduce of the rows when they match; nothing at all for one rank.
    # Per rank (count, length, digest, 8 inline numbers): 2 + 4 + 8 int64 words.
    expected = [] if n == 1 else [("allreduce", "dp_plugin.agree", n * (16 + DIGEST_SIZE + 64))]
    assert all(e.log == expected for e in engines)


def _mismatch(n: int, layouts: dict[int, list[TensorSpec]]) -> list[BaseException]:
    engines = make_thread_group(n)

    def body(e: FakeEngine) -> None:
        agree(e, layouts.get(e.rank, model()), what="parameters")

    outcomes = run_ranks_outcomes(engines, body)
    assert all(isinstance(o, LayoutMismatchError) for o in outcomes), outcomes
    # Every rank ran the same collectives, so none could have been left waiting.
    calls = [[(kind, name) for kind, name, _ in e.log] for e in engines]
    assert all(c == calls[0] for c in calls)
    assert len(calls[0]) == 2  # digest and lengths, then the descriptions
    return outcomes


def test_shape_mismatch_raises_on_every_rank() -> None:
    other = model()
    other[2] = TensorSpec("layer2.weight", (3, 4), "float32")
    errors = _mismatch(3, {2: other})
    for rank, err in enumerate(errors):
        msg = str(err)
        assert msg.startswith(f"rank {rank}: the parameters")
        assert "position 2" in msg
        assert "rank 0 has tensor 'layer2.weight' shape (3, 3) float32" in msg
        assert "rank(s) 2 have tensor 'layer2.weight' shape (3, 4) float32" in msg
        assert "same order" in msg


def test_first_difference_is_named_with_all_differing_ranks() -> None:
    renamed = model()
    renamed[1] = TensorSpec("layer1.bias", (2, 3), "float32")
    errors = _mismatch(3, {1: renamed, 2: renamed})
    assert "position 1" in str(errors[0])
    assert "rank(s) 1, 2 have tensor 'layer1.bias'" in str(errors[0])


def test_extra_and_missing_tensors() -> None:
    errors = _mismatch(2, {1: model(5)})
    msg = str(errors[1])
    assert "position 4: rank 0 has no tensor there" in msg
    assert "rank(s) 1 have tensor 'layer4.weight'" in msg
    assert "tensor counts: rank 0: 4, rank 1: 5" in msg

    errors = _mismatch(2, {1: model(3)})
    assert "rank(s) 1 have no tensor there" in str(errors[0])


def test_dtype_and_order_mismatch() -> None:
    halved = model()
    halved[0] = TensorSpec("layer0.weight", (1, 3), "float16")
    assert "float16" in str(_mismatch(2, {0: halved})[1])
    swapped = model()
    swapped[0], swapped[1] = swapped[1], swapped[0]
    msg = str(_mismatch(2, {1: swapped})[0])
    assert "position 0" in msg and "'layer1.weight'" in msg


def test_describe_mismatch_when_layouts_agree() -> None:
    same = [["w", [1], "float32", "cpu"]]
    assert layout_text({0: same, 1: same}, "gradients", 0) is None
    assert "corrupted" in settings_text({0: {"a": "1"}, 1: {"a": "1"}}, "gradients", 0)


@pytest.mark.parametrize(("key", "values"), [
    ("fusion threshold", (4096, 1024)),
    ("compression", ("none", "fp16")),
    ("prescale", (1.0, 0.5)),
])
def test_differing_settings_raise_on_every_rank_naming_both_values(
    key: str, values: tuple[object, object]
) -> None:
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> None:
        agree(e, model(), what="gradients", settings={key: values[e.rank]})

    outcomes = run_ranks_outcomes(engines, body)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, LayoutMismatchError), outcomes
        msg = str(err)
        assert msg.startswith(f"rank {rank}: the gradients use different settings")
        assert f"{key} differs (rank 0: {values[0]!r}; rank 1: {values[1]!r})" in msg


def test_a_setting_on_one_rank_only_differs() -> None:
    def body(e: FakeEngine) -> None:
        agree(e, model(), settings={"compression": "fp16"} if e.rank else None)

    for err in run_ranks_outcomes(make_thread_group(2), body):
        assert isinstance(err, LayoutMismatchError)
        assert "compression differs (rank 0: <unset>; rank 1: 'fp16')" in str(err)


def test_one_error_type_carries_its_problem() -> None:
    assert all(isinstance(e, MismatchError) and e.problem is Problem.LAYOUT
               for e in _mismatch(2, {1: model(3)}))

    def body(e: FakeEngine) -> None:
        buf = np.zeros(2, np.complex64 if e.rank else np.float32)
        check(e, Request.of("allreduce", [buf], name="g"))

    for err in run_ranks_outcomes(make_thread_group(2), body):
        assert isinstance(err, MismatchError) and isinstance(err, TypeError), err
        assert err.problem is Problem.UNSUPPORTED_DTYPE


@pytest.mark.parametrize(("roots", "problem"), [((0, 1), Problem.DIFFERENT),
                                                ((0, 7), Problem.BAD_ROOT)])
def test_a_broadcast_of_objects_checks_its_root_on_every_rank(
    roots: tuple[int, int], problem: Problem
) -> None:
    def body(e: FakeEngine) -> int:
        with calling("hvd.broadcast_object()"):
            return agreed_root(e, roots[e.rank])

    assert run_ranks_outcomes(make_thread_group(2), lambda e: agreed_root(e, 1)) == [1, 1]
    for err in run_ranks_outcomes(make_thread_group(2), body):
        assert isinstance(err, MismatchError) and err.problem is problem, err
        assert "passed different root_rank values" in str(err)
        assert "'hvd.broadcast_object()'" in str(err)


def test_control_buffers_move_to_the_engines_device() -> None:
    arr = np.arange(3, dtype=np.int64)
    assert to_device(arr, "cpu") is arr
    assert to_host(arr) is arr
    torch = pytest.importorskip("torch")
    moved = to_device(arr, "meta")  # a non-CPU device that exists without a GPU
    assert moved.device.type == "meta" and moved.dtype == torch.int64
    assert to_host(torch.arange(3)).tolist() == [0, 1, 2]


def process_set(members: tuple[int, ...]) -> list[FakeEngine]:
    """The engines of a process set of the job ranks ``members`` (what
    ``Engine.subgroup`` gives its members)."""
    engines = make_thread_group(len(members))
    for e in engines:
        e.global_ranks = members
    return engines


def test_a_process_sets_mismatch_names_job_ranks() -> None:
    """In the process set [1, 2], a root mismatch named 'rank(s) 0' (not a
    member) and 'rank(s) 1': the ranks' places in the set."""
    def body(e: FakeEngine) -> object:
        buf = np.zeros(3, np.float32)
        return check(e, Request.of("broadcast", [buf], name="w", root=e.job_rank))

    errors = run_ranks_outcomes(process_set((1, 2)), body)
    for err in errors:
        assert isinstance(err, MismatchError), err
        assert "rank(s) 1 passed root_rank=1; rank(s) 2 passed root_rank=2" in str(err), err

    def bad_dtype(e: FakeEngine) -> object:
        buf = np.zeros(3, np.complex64 if e.job_rank == 2 else np.float32)
        return check(e, Request.of("allreduce", [buf], name="g"))

    for err in run_ranks_outcomes(process_set((1, 2)), bad_dtype):
        assert isinstance(err, MismatchError) and err.problem is Problem.UNSUPPORTED_DTYPE, err
        assert "cannot run: rank(s) [2] passed a tensor of dtype complex64" in str(err), err


def test_a_fused_layout_mismatch_in_a_process_set_names_job_ranks() -> None:
    def body(e: FakeEngine) -> None:
        agree(e, model(3 if e.job_rank == 5 else 4))

    for err, me in zip(run_ranks_outcomes(process_set((3, 5)), body), (3, 5), strict=True):
        assert isinstance(err, LayoutMismatchError), err
        text = str(err)
        assert text.startswith(f"rank {me}: the gradients registered"), text
        assert "rank 3 has tensor 'layer3.weight'" in text and "rank(s) 5 have no tensor" in text
        assert "(tensor counts: rank 3: 4, rank 5: 3)" in text, text
