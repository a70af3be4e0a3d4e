"""PowerSGD's framework-free part (``dp_plugin.reduce.powersgd``) and ``dp-plugin
plan --powersgd-rank``: which tensors are compressed, the wire formula
(``sum((n + m) * r)`` over the compressed matrices plus the uncompressed
elements), the settings' checks, and the plan's prediction."""

from __future__ import annotations

import json

import pytest

from dp_plugin.cli import main
from dp_plugin.cli.alphabeta import Link, predict, predict_powersgd, ring_allreduce_time
from dp_plugin.cli.shapes import model_shapes
from dp_plugin.reduce.powersgd import PowerSGDSettings, flops, matrix_of, touched_bytes, wire_numel

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
    assert touched_bytes(shapes, PowerSGDSettings(rank=2)) == 11 * 4 * (768 * 3072 + 40 * 12)


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


def test_the_prediction_counts_two_all_reduces_and_the_products_per_bucket() -> None:
    """One bucket of one 768 x 3072 matrix and its bias, compute long over:
    the step is backward's end plus the P+bias all-reduce, the Q all-reduce
    and the products."""
    shapes = [(768, 3072), (3072,)]
    link = Link(alpha=50e-6, beta=1e9 / 8)
    s = PowerSGDSettings(rank=4)
    got = predict_powersgd(shapes, 1.0, 4, link, 64 << 20, s, 20e9, 5e9, backward_fraction=1.0)
    work = max(6 * 768 * 3072 * 4 / 20e9, 11 * 4 * 768 * 3072 / 5e9)
    t = (ring_allreduce_time(4 * (768 * 4 + 3072), 4, link)
         + ring_allreduce_time(4 * 3072 * 4, 4, link) + work)
    assert got.buckets == 1
    assert got.step_s == pytest.approx(1.0 + t)
    plain = predict([4 * 768 * 3072, 4 * 3072], 1.0, 4, link, 64 << 20, backward_fraction=1.0)
    assert got.step_s < plain.step_s


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
    assert main([*args, "--powersgd-rank", "4"]) == 0
    assert "PowerSGD at rank 4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--powersgd-rank 0: PowerSGD: rank must be"):
        main([*args, "--powersgd-rank", "0"])
