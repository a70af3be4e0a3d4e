"""PowerSGD's framework-free part (``dp_plugin.reduce.powersgd``) and ``dp-plugin
plan --powersgd-rank``: which tensors are compressed, the wire formula
(``sum((n + m) * r)`` over the compressed matrices plus the uncompressed
elements), the settings' checks, and the plan's prediction."""

from __future__ import annotations

import json
import math

import pytest

from dp_plugin.cli import main
from dp_plugin.cli.alphabeta import (
    UNPACK_PASSES,
    Link,
    allreduce_time,
    predict,
    predict_powersgd,
    ring_allreduce_time,
)
from dp_plugin.cli.plan import LOCAL_GBIT
from dp_plugin.cli.shapes import model_shapes
from dp_plugin.config import Config
from dp_plugin.reduce.powersgd import (
    PASSES,
    WHOLE_PASSES,
    PowerSGDSettings,
    flops,
    matrix_of,
    touched_bytes,
    wire_numel,
)

R4 = PowerSGDSettings(rank=4)


def test_matrices_are_compressed_only_where_it_pays() -> None:
    assert matrix_of((768, 3072), R4) == (768, 3072, 4)
    assert matrix_of((64, 3, 7, 7), R4) == (64, 147, 4)  # a convolution: out x (in*kh*kw)
    assert matrix_of((768,), R4) is None  # biases and norms travel whole
    assert matrix_of((2, 768), R4) is None  # (2 + 768) * 2 * 2 > 2 * 768
    assert matrix_of((16, 16), R4) is None  # (16 + 16) * 4 * 2 = 256: not < 256
    assert matrix_of((17, 17), R4) == (17, 17, 4)  # 272 < 289
    assert matrix_of((3, 1000), PowerSGDSettings(rank=8, min_compression_rate=1.0)) is None
    assert matrix_of((5, 1000), PowerSGDSettings(rank=8, min_compression_rate=1.0)) is None
    assert matrix_of((1000, 5), PowerSGDSettings(rank=2)) == (1000, 5, 2)


def test_the_wire_formula_by_hand() -> None:
    shapes = [(768, 3072), (3072,), (40, 12), (3, 24)]
    w = wire_numel(shapes, PowerSGDSettings(rank=2))
    assert (w.p, w.q) == (768 * 2 + 40 * 2, 3072 * 2 + 12 * 2)
    assert w.whole == 3072 + 3 * 24
    assert w.total == (768 + 3072) * 2 + (40 + 12) * 2 + 3072 + 72
    assert w.dense == 768 * 3072 + 3072 + 480 + 72
    assert w.ratio == pytest.approx(w.dense / w.total)
    assert flops(shapes, PowerSGDSettings(rank=2)) == 6 * 2 * (768 * 3072 + 40 * 12)
    assert (PASSES, WHOLE_PASSES) == (11, 4)
    assert touched_bytes(shapes, PowerSGDSettings(rank=2)) == \
        11 * 4 * (768 * 3072 + 40 * 12) + 4 * 4 * (3072 + 72)


def test_bert_base_at_rank_4() -> None:
    """Every BERT-base matrix is compressed (the embeddings too); the norms,
    biases and the 2 x 768 token-type table travel whole."""
    shapes = [shape for _, shape in model_shapes("bert-base")]
    w = wire_numel(shapes, R4)
    whole = sum(s[0] for s in shapes if len(s) == 1) + 2 * 768
    assert w.whole == whole
    assert w.dense == 109_482_240
    expected = sum((s[0] + s[1]) * 4 for s in shapes if len(s) == 2 and s != (2, 768))
    assert w.p + w.q == expected
    assert 100 < w.ratio < 150


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"rank": 0}, "rank must be an int >= 1, got 0"),
    ({"rank": 2.5}, "rank must be an int >= 1, got 2.5"),
    ({"rank": True}, "rank must be an int >= 1, got True"),
    ({"start_iter": -1}, "start_iter must be an int >= 0, got -1"),
    ({"min_compression_rate": 0.5}, "min_compression_rate must be >= 1.0, got 0.5"),
    ({"min_compression_rate": 0}, "min_compression_rate must be a finite number > 0"),
    ({"seed": "x"}, "seed must be an int, got 'x'"),
    ({"epsilon": 0}, "epsilon must be a finite number > 0"),
])
def test_bad_settings_say_what_is_wrong(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match="PowerSGD") as info:
        PowerSGDSettings(**kwargs)
    assert words in str(info.value)


def test_the_prediction_counts_two_all_reduces_and_the_work_per_bucket() -> None:
    """One bucket of one 768 x 3072 matrix and its bias, compute long over:
    the step is backward's end plus the P+bias all-reduce, the Q all-reduce
    and the work: the products or the passes (11 over the matrix, 4 over
    the bias, and the unpack's 2 over both), whichever is longer."""
    shapes = [(768, 3072), (3072,)]
    link = Link(alpha=50e-6, beta=1e9 / 8)
    s = PowerSGDSettings(rank=4)
    got = predict_powersgd(shapes, 1.0, 4, link, 64 << 20, s, 20e9, 5e9, backward_fraction=1.0)
    touched = 4 * (11 * 768 * 3072 + 4 * 3072 + UNPACK_PASSES * (768 * 3072 + 3072))
    work = max(6 * 768 * 3072 * 4 / 20e9, touched / 5e9)
    assert work == touched / 5e9  # at rank 4 on a CPU core the passes take longer
    t = (ring_allreduce_time(4 * (768 * 4 + 3072), 4, link)
         + ring_allreduce_time(4 * 3072 * 4, 4, link) + work)
    assert got.buckets == 1
    assert got.step_s == pytest.approx(1.0 + t)
    plain = predict([4 * 768 * 3072, 4 * 3072], 1.0, 4, link, 64 << 20, backward_fraction=1.0)
    assert got.step_s < plain.step_s


def test_the_work_runs_in_series_with_backward() -> None:
    """Two buckets, one matrix each (the second defined is ready first, half
    way through backward): its work on the rank, unlike its all-reduces,
    does not hide behind the rest of backward but delays it, so the step is
    compute, both buckets' work and the last bucket's two all-reduces."""
    a, b = (1024, 2048), (512, 4096)
    link = Link(alpha=50e-6, beta=1e9 / 8)
    s = PowerSGDSettings(rank=4)
    cap = 4 * 1024 * 2048  # one matrix per bucket

    def work(shape: tuple[int, int]) -> float:
        return (11 + UNPACK_PASSES) * 4 * shape[0] * shape[1] / 5e9

    got = predict_powersgd([a, b], 1.0, 4, link, cap, s, 20e9, 5e9, backward_fraction=1.0)
    assert got.buckets == 2
    wire_a = (ring_allreduce_time(4 * a[0] * 4, 4, link)
              + ring_allreduce_time(4 * a[1] * 4, 4, link))
    assert got.step_s == pytest.approx(1.0 + work(b) + work(a) + wire_a)


def test_the_prediction_takes_the_hierarchical_path() -> None:
    """Each all-reduce priced as the plain model prices it on that path."""
    shape = (768, 3072)
    link = Link(alpha=50e-6, beta=1e9 / 8)
    inside = Link(alpha=5e-6, beta=40e9 / 8)
    s = PowerSGDSettings(rank=4)
    got = predict_powersgd([shape], 1.0, 4, link, 64 << 20, s, 20e9, 5e9,
                           backward_fraction=1.0, per_host=2, local=inside)
    wire = (allreduce_time(4 * 768 * 4, 4, link, 2, inside)
            + allreduce_time(4 * 3072 * 4, 4, link, 2, inside))
    assert wire != ring_allreduce_time(4 * 768 * 4, 4, link) \
        + ring_allreduce_time(4 * 3072 * 4, 4, link)
    assert got.step_s == pytest.approx(1.0 + wire + 13 * 4 * 768 * 3072 / 5e9)


def test_plan_prints_the_powersgd_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "bert-base", "--compute-ms", "900", "--alpha-us", "50",
            "--bandwidth-gbit", "1", "--ranks-per-host", "2", "--workers", "4"]
    assert main([*args, "--powersgd-rank", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["powersgd"]
    shapes = [shape for _, shape in model_shapes("bert-base")]
    assert out["wire_bytes"] == 4 * wire_numel(shapes, R4).total
    assert out["dense_bytes"] == 4 * 109_482_240
    (row,) = out["rows"]
    assert row["workers"] == 4 and row["step_ms"] < row["plain_step_ms"]
    # 2 hosts of 2 ranks: the gloo engine's hierarchical path, for both steps
    sizes = [4 * math.prod(s) for s in shapes]
    cap, first = Config().bucket_caps(total_bytes=sum(sizes))
    inside = Link(alpha=5e-6, beta=LOCAL_GBIT * 1e9 / 8)
    link = Link(alpha=50e-6, beta=1e9 / 8)
    plain = predict(sizes, 0.9, 4, link, cap, per_host=2, local=inside, first_threshold=first)
    assert row["path"] == "hierarchical"
    assert row["plain_step_ms"] == pytest.approx(plain.step_s * 1e3)
    assert main([*args, "--powersgd-rank", "4"]) == 0
    assert "PowerSGD at rank 4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--powersgd-rank 0: PowerSGD: rank must be"):
        main([*args, "--powersgd-rank", "0"])
