"""The ``dp-plugin`` command: argument parsing, bandwidth arithmetic, the
alpha-beta model with known values, model shape lists, the Horovod build's
patch step and the bench report (no processes started here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dp_plugin.cli import parse
from dp_plugin.cli.alphabeta import Link, buckets, fit_link, predict, ring_allreduce_time
from dp_plugin.cli.bandwidth import algbw, bus_factor, busbw, loopback_tcp_time, memcpy_time
from dp_plugin.cli.bench import parse_size, sizes_between
from dp_plugin.cli.build_horovod import (
    PATCH_SET,
    BuildError,
    cache_dir,
    mark_patch_set,
    patch_cxx_standard,
    patch_process_set_iface,
)
from dp_plugin.cli.progress import Progress
from dp_plugin.cli.report import markdown
from dp_plugin.cli.shapes import MODELS, model_shapes, param_count

# -- argument parsing ----------------------------------------------------------


def test_every_subcommand_parses_and_knows_its_module() -> None:
    assert parse(["check"]).module.__name__ == "dp_plugin.cli.check"
    assert parse(["build-horovod", "--force"]).force is True
    args = parse(["bench", "--out", "o", "--engines", "gloo", "--world-sizes", "2",
                  "--max-size", "1M", "--models", "none"])
    assert (args.engines, args.world_sizes, args.max_size, args.models) == \
        (["gloo"], [2], 2**20, [])
    args = parse(["plan", "--model", "resnet50", "--compute-ms", "100", "--alpha-us", "5",
                  "--bandwidth-gbit", "25", "--workers", "8,64"])
    assert (args.model, args.compute_ms, args.workers) == ("resnet50", 100.0, [8, 64])


def test_bench_defaults_are_the_issues_sweep() -> None:
    args = parse(["bench", "--out", "o"])
    assert args.world_sizes == [2, 3] and args.models == ["bert-base", "resnet50"]
    sizes = sizes_between(args.min_size, args.max_size)
    assert sizes[0] == 4 * 2**10 and sizes[-1] == 256 * 2**20 and len(sizes) == 17


@pytest.mark.parametrize("argv, needle", [
    (["bench"], "--out"),
    (["bench", "--out", "o", "--engines", "tcp"], "unknown tcp"),
    (["bench", "--out", "o", "--world-sizes", "1"], "world sizes >= 2"),
    (["bench", "--out", "o", "--max-size", "lots"], "not a size"),
    (["bench", "--out", "o", "--models", "gpt5"], "unknown gpt5"),
    (["plan", "--model", "resnet50", "--compute-ms", "-1"], "must be positive"),
    (["plan", "--model", "resnet50", "--compute-ms", "1", "--workers", "a,b"], "integers"),
    (["nonsense"], "invalid choice"),
])
def test_bad_arguments_exit_2_naming_the_value(argv: list[str], needle: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_parse_size_units() -> None:
    assert [parse_size(s) for s in ("4K", "4KiB", "256M", "1G", "4096", "1.5K")] == \
        [4096, 4096, 256 * 2**20, 2**30, 4096, 1536]


def test_plan_without_a_link_says_what_to_give() -> None:
    from dp_plugin.cli import main

    with pytest.raises(SystemExit, match="--alpha-us"):
        main(["plan", "--model", "resnet50", "--compute-ms", "100"])


# -- bandwidth (nccl-tests' definitions) ---------------------------------------


def test_busbw_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert algbw(1e9, 0.5) == 2e9
    assert busbw(1e9, 0.5, 2) == pytest.approx(2e9)  # factor 1 at two ranks
    assert busbw(1e9, 0.5, 4) == pytest.approx(2e9 * 1.5)
    assert busbw(1e9, 1.0, 1) == 0.0
    assert bus_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="positive"):
        algbw(1, 0.0)


def test_reference_links_measure_something() -> None:
    assert 0 < memcpy_time(1 << 16, reps=3, warmup=1) < 1.0
    assert 0 < loopback_tcp_time(1 << 16, reps=3, warmup=1) < 5.0


# -- alpha-beta model -----------------------------------------------------------


def test_ring_allreduce_time_known_values() -> None:
    link = Link(alpha=1e-5, beta=1e9)
    assert ring_allreduce_time(1e9, 1, link) == 0.0
    assert ring_allreduce_time(1e9, 2, link) == pytest.approx(2e-5 + 1.0)
    assert ring_allreduce_time(8e8, 8, link) == pytest.approx(14e-5 + 1.75 * 0.8)


def test_fit_link_recovers_alpha_and_beta() -> None:
    true = Link(alpha=2e-5, beta=5e8)
    points = [(s, ring_allreduce_time(s, 3, true)) for s in (4096, 2**20, 2**28)]
    fitted = fit_link(points, 3)
    assert fitted.beta == pytest.approx(true.beta, rel=0.01)
    assert fitted.alpha == pytest.approx(true.alpha, rel=0.05)


def test_buckets_are_greedy_and_a_big_tensor_stands_alone() -> None:
    assert buckets([1, 1, 1, 5, 1], 2) == [(1, 2), (2, 1), (3, 5), (4, 1)]
    assert buckets([1, 1, 1], 100) == [(2, 3)]


def test_predict_known_values() -> None:
    link = Link(alpha=0.0, beta=1e9)
    # One bucket of 1 GB at 2 workers: 1 s all-reduce after a 0.3 s step's backward.
    one = predict([5 * 10**8, 5 * 10**8], 0.3, 2, link, threshold=2 * 10**9)
    assert (one.buckets, one.comm_s, one.step_s) == (1, pytest.approx(1.0), pytest.approx(1.3))
    assert one.efficiency == pytest.approx(0.3 / 1.3)
    # Two buckets: the first (the last tensor, ready mid-backward at 0.2 s) overlaps.
    two = predict([5 * 10**8, 5 * 10**8], 0.3, 2, link, threshold=6 * 10**8)
    assert two.buckets == 2 and two.step_s == pytest.approx(0.2 + 1.0)
    # Communication shorter than the rest of backward hides completely.
    hidden = predict([1000] * 10, 1.0, 64, Link(alpha=0.0, beta=1e12), threshold=1000)
    assert hidden.efficiency == pytest.approx(1.0)
    assert predict([1000], 1.0, 1, link, threshold=1).efficiency == 1.0


def test_predict_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="compute"):
        predict([4], 0.0, 2, Link(0.0, 1.0), threshold=4)
    with pytest.raises(ValueError, match="alpha"):
        Link(alpha=-1.0, beta=1.0)


# -- shape lists ----------------------------------------------------------------


@pytest.mark.parametrize("model, params", [
    ("bert-base", 109_482_240), ("resnet50", 25_557_032), ("resnet101", 44_549_160),
    ("vgg16", 138_357_544), ("inception-v3", 23_834_568), ("encoder-mlm", 7_461_120),
])
def test_shape_lists_match_the_reference_parameter_counts(model: str, params: int) -> None:
    shapes = model_shapes(model)
    assert param_count(shapes) == params
    assert len({name for name, _ in shapes}) == len(shapes)


def test_bert_base_and_resnet50_are_the_well_known_sizes() -> None:
    assert math.isclose(param_count(model_shapes("bert-base")), 110e6, rel_tol=0.01)
    assert math.isclose(param_count(model_shapes("resnet50")), 25.6e6, rel_tol=0.01)
    assert len(model_shapes("encoder-mlm")) == 58
    with pytest.raises(ValueError, match="known models"):
        model_shapes("gpt5")
    assert "bert-base" in MODELS


# -- build-horovod ---------------------------------------------------------------


def test_patch_raises_the_cxx_standard_in_both_files(tmp_path: Path) -> None:
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("project(x)\nset(CMAKE_CXX_STANDARD 14)\n")
    patch_cxx_standard(tmp_path)
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        assert "set(CMAKE_CXX_STANDARD 17)" in (tmp_path / rel).read_text()
    with pytest.raises(BuildError, match="no longer applies"):
        patch_cxx_standard(tmp_path)  # already patched: the line is gone


def test_wheel_cache_is_keyed_by_versions(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_PLUGIN_WHEEL_CACHE", str(tmp_path))
    # The patch set is part of the key: an older patch set's wheel is never reused.
    assert cache_dir(None, "2.13.0", "cp311") == tmp_path / "horovod-0.28.1-p2-torch2.13.0-cp311"


GLOO_CONTEXT = """void GlooContext::Initialize(const std::string& gloo_iface) {
  attr device_attr;
  device_attr.iface = gloo_iface_;
}
void GlooContext::InitializeForProcessSet(const GlooContext& global_context,
                                          const std::vector<int>& registered_ranks) {
  attr device_attr;
  device_attr.iface = gloo_iface_;
  device_attr.ai_family = AF_UNSPEC;
}
"""


def test_process_sets_get_the_global_interface(tmp_path: Path) -> None:
    """Only the process-set function changes; a second application fails loudly."""
    f = tmp_path / "horovod/common/gloo/gloo_context.cc"
    f.parent.mkdir(parents=True)
    f.write_text(GLOO_CONTEXT)
    patch_process_set_iface(tmp_path)
    head, _, process_set = f.read_text().partition("InitializeForProcessSet")
    assert "global_context" not in head.replace("const GlooContext& global_context", "")
    assert ("  gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;\n"
            in process_set)
    with pytest.raises(BuildError, match="no longer applies"):
        patch_process_set_iface(tmp_path)
    f.write_text(GLOO_CONTEXT.replace("InitializeForProcessSet", "InitializeSet"))
    with pytest.raises(BuildError, match="no longer applies"):
        patch_process_set_iface(tmp_path)


def test_the_wheel_names_its_patch_set(tmp_path: Path) -> None:
    (tmp_path / "horovod").mkdir()
    mark_patch_set(tmp_path)
    scope: dict[str, object] = {}
    exec((tmp_path / "horovod" / "dp_plugin_patches.py").read_text(), scope)
    assert scope["PATCH_SET"] == PATCH_SET


# -- bench report ----------------------------------------------------------------


def test_markdown_table_has_busbw_and_references() -> None:
    result = {"sizes": [2**20], "skipped": {"nccl": "no CUDA"},
              "sweep": [{"engine": "gloo", "size": 3, "bytes": 2**20, "time_s": 0.001}],
              "references": [{"bytes": 2**20, "loopback_tcp_s": 0.0005, "memcpy_s": 0.0001}],
              "models": [{"model": "resnet50", "engine": "gloo", "size": 3, "bytes": 4096,
                          "tensors": 161, "buckets": 1, "fused_s": 0.02, "raw_s": 0.01}]}
    md = markdown(result)
    # 1 MiB in 1 ms: algbw 1.05 GB/s, busbw x 4/3 = 1.40 GB/s.
    assert "| 1 MiB | 1.000 ms / 1.049 / 1.398 | 2.097 | 10.486 |" in md
    # An old results.json without the views column: copies stand in for views.
    assert ("| resnet50 | gloo | 3 | 161 (4 KiB) | 1 | 20.0 ms | 20.0 ms | - | 10.0 ms | 0.50 "
            "| - | - | - | - | - |") in md
    assert "Not run: nccl (no CUDA)" in md
    result["models"] = [{"model": "bert-base", "engine": "horovod", "size": 2, "bytes": 4096,
                         "tensors": 199, "buckets": 7, "fused_s": 0.02, "fused_views_s": 0.0125,
                         "fused_views_sum_s": 0.01, "raw_s": 0.0125,
                         "horovod_grouped_s": 0.05, "per_tensor_s": 0.1}]
    assert ("| bert-base | horovod | 2 | 199 (4 KiB) | 7 | 20.0 ms | 12.5 ms | 10.0 ms "
            "| 12.5 ms | 1.00 | 1.25 | 50.0 ms | 4.00 | 100.0 ms | 8.00 |") in markdown(result)


def test_bench_worker_times_copies_views_and_raw_on_one_engine() -> None:
    pytest.importorskip("torch")
    from dp_plugin.cli.bench_worker import _fused
    from dp_plugin.config import Config
    from dp_plugin.engines.local import LocalEngine
    from dp_plugin.launch.launchers import Topology

    engine = LocalEngine(Topology.single(), Config())
    row = _fused(engine, "encoder-mlm", reps=2, warmup=0, per_tensor=True)
    assert row["tensors"] > 20 and row["bytes"] > 20 << 20 and row["buckets"] >= 2
    assert min(row["fused_s"], row["fused_views_s"], row["fused_views_sum_s"], row["raw_s"],
               row["per_tensor_s"]) > 0
    assert "horovod_grouped_s" not in row  # only under the horovod engine


def test_progress_bar_counts_to_total() -> None:
    import io

    stream = io.StringIO()
    bar = Progress(4, stream=stream, width=8)
    bar.label = "gloo x2"
    bar.advance(2)
    assert bar.render().startswith("[####....] 2/4 gloo x2")
    bar.advance(10)
    assert bar.done == 4


def test_plots_are_small_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dp_plugin.cli.report import draw_plots

    result = {"sizes": [4096, 8192],
              "sweep": [{"engine": "gloo", "size": 2, "bytes": b, "time_s": 1e-3}
                        for b in (4096, 8192)],
              "references": [{"bytes": b, "loopback_tcp_s": 1e-4, "memcpy_s": 1e-5}
                             for b in (4096, 8192)]}
    for path in draw_plots(result, tmp_path):
        data = path.read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) < 100_000


def test_plan_fits_the_link_from_a_sweep_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dp_plugin.cli import main

    true = Link(alpha=1e-4, beta=1e8)
    rows = [{"engine": "gloo", "size": n, "bytes": s, "time_s": ring_allreduce_time(s, n, true)}
            for n in (2, 3) for s in (4096, 2**20, 2**26)]
    sweep = tmp_path / "results.json"
    sweep.write_text(json.dumps({"sweep": rows}))
    assert main(["plan", "--model", "resnet50", "--compute-ms", "100", "--sweep", str(sweep),
                 "--fit-size", "2", "--workers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["beta_bytes_s"] == pytest.approx(1e8, rel=0.01)
    assert out["alpha_s"] == pytest.approx(1e-4, rel=0.05)
    with pytest.raises(SystemExit, match="world sizes 2, 3 only"):
        main(["plan", "--model", "resnet50", "--compute-ms", "100", "--sweep", str(sweep),
              "--fit-size", "5"])
    with pytest.raises(SystemExit, match="no rows for it"):
        main(["plan", "--model", "resnet50", "--compute-ms", "100", "--sweep", str(sweep),
              "--engine", "mpi"])


# -- check ---------------------------------------------------------------------------


@pytest.mark.parametrize(("usable", "expected"), [
    ({"mpi", "gloo", "local"}, "would pick 'mpi' (launched by mpich; mpi is available"),
    ({"gloo", "local"}, "would pick 'gloo' (launched by mpich; mpi is not available"),
])
def test_check_names_the_engine_auto_picks(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        usable: set[str], expected: str) -> None:
    """Under mpirun ``auto`` picks mpi, else gloo, and says why."""
    from dp_plugin import engines
    from dp_plugin.cli import check
    from dp_plugin.engines.base import Availability
    from dp_plugin.launch import launchers as launch
    from dp_plugin.launch.launchers import Topology

    topo = Topology(launcher="mpich", rank=0, size=2, local_rank=0, local_size=2,
                    cross_rank=0, cross_size=1)
    monkeypatch.setattr(launch, "detect", lambda env=None: topo)
    monkeypatch.setattr(engines, "availability",
                        lambda name, t: Availability(name in usable, "test"))
    monkeypatch.setattr(check, "_frameworks", list)  # the imports are tested below
    assert check.main() == 0
    out = capsys.readouterr().out
    assert f"launcher mpich, rank 0 of 2; DP_PLUGIN_ENGINE=auto {expected}" in out


def test_check_finds_launchers_beside_the_interpreter(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A venv's bin/ that is not on PATH (dp-plugin run by its full path)."""
    from dp_plugin.cli import check

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(check.sys, "executable", str(bin_dir / "python"))
    path, where = check.find_launcher("torchrun")
    assert path == str(bin_dir / "torchrun") and "beside the interpreter" in where
    path, where = check.find_launcher("srun")
    assert path is None and str(bin_dir) in where


def test_check_by_full_path_prints_each_line_once_without_tensorflow_noise() -> None:
    """Run as a user runs it: ``.venv/bin/dp-plugin check`` with the venv off PATH."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "dp-plugin"
    done = subprocess.run([str(script), "check"], capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}, check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    for noise in ("absl::InitializeLog", "oneDNN custom operations"):
        assert noise not in text, text
    assert f"{Path(sys.executable).parent / 'torchrun'} (beside the interpreter" in text, text
    assert "TensorFlow  2." in text and "(import " in text, text
    assert "The check took " in text, text


@pytest.mark.parametrize(("found", "served"), [
    ({"tensorflow": True, "torch": True}, "serves tensorflow and torch"),
    ({"tensorflow": False, "torch": True}, "serves torch"),
    ({"tensorflow": False, "torch": False}, "serves neither backend: install torch or tensorflow"),
])
def test_check_lists_the_keras_backends_dp_plugin_serves(found: dict[str, bool],
                                                         served: str) -> None:
    from dp_plugin.cli import check

    name, ok, info = check._keras_row(True, "3.15.1", "tensorflow", found)
    assert (name, ok) == ("Keras", True)
    assert "backend '" in info and served in info


def test_check_lists_lightning_from_its_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from dp_plugin.cli import check

    versions = {"pytorch-lightning": "2.6.0"}

    def version(dist: str) -> str:
        if dist not in versions:
            raise metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(metadata, "version", version)
    assert check._lightning() == (
        True, 'pytorch-lightning 2.6.0, Trainer(strategy="horovod") after import '
              "dp_plugin.lightning")
    versions.clear()
    assert check._lightning() == (False, "not installed: pip install 'dp_plugin[lightning]'")


def test_check_under_horovodrun_names_gloo_and_how_to_get_horovods_ring(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On CPUs under horovodrun, auto picks gloo even where Horovod's engine can run."""
    from dp_plugin import engines
    from dp_plugin.cli import check
    from dp_plugin.engines.base import Availability
    from dp_plugin.launch import launchers as launch
    from dp_plugin.launch.launchers import Topology

    topo = Topology(launcher="horovodrun", rank=0, size=2, local_rank=0, local_size=2,
                    cross_rank=0, cross_size=1)
    monkeypatch.setattr(launch, "detect", lambda env=None: topo)
    monkeypatch.setattr(engines, "availability",
                        lambda name, t: Availability(name in {"horovod", "gloo"}, "test"))
    assert check.main() == 0
    out = capsys.readouterr().out
    assert "DP_PLUGIN_ENGINE=auto would pick 'gloo' (launched by horovodrun on CPUs" in out
    assert "one choice for the job at init()" in out and "DP_PLUGIN_ENGINE=horovod" in out
