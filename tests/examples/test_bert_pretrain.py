"""The main job (examples/bert_pretrain.py) end to end, under real launchers.

A tiny BERT (flags) for a dozen steps: the loss falls; a run stopped at
step 6 and resumed from its checkpoint logs the same losses for steps 7-12
as a run that never stopped (model, optimizer, LR schedule, per-rank RNG
states and data position all restored). The uninterrupted run goes through
mpirun (MPI engine), the interrupted one through torchrun (Gloo): the script
is the same for every launcher.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "bert_pretrain.py"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "32",
        "--vocab-size", "1000", "--global-batch", "16", "--steps", "12", "--warmup-steps", "2",
        "--lr", "2e-3", "--log-every", "1", "--checkpoint-every", "6", "--no-progress"]


def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss (\d+\.\d+)", output)}


@pytest.mark.multiproc
@pytest.mark.slow
def test_loss_falls_and_a_resumed_run_continues_exactly(tmp_path: Path) -> None:
    env = {"DP_PLUGIN_TIMEOUT": "60"}
    whole = run_workers("mpirun", 2, SCRIPT, args=[*TINY, "--output-dir", str(tmp_path / "a")],
                        env=env, timeout=240)
    losses = _losses(whole.output)
    assert sorted(losses) == list(range(1, 13)), whole.output
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (10, 11, 12)) / 3
    assert last < first - 0.3, f"loss did not fall: {losses}"
    assert "summary: workers 2" in whole.output and "communication hidden" in whole.output
    assert (tmp_path / "a" / "model" / "config.json").exists()

    # WordPiece training breaks ties differently from process to process:
    # run b is handed run a's vocabulary (the cache would give it too).
    out_b = ["--output-dir", str(tmp_path / "b"), "--tokenizer", str(tmp_path / "a" /
                                                                      "tokenizer.json")]
    # The stopped run under the harness's env launcher (ranks forked warm,
    # torchrun's variables); the whole run is mpirun's, the resumed torchrun's.
    stopped = run_workers("env", 2, SCRIPT, args=[*TINY, *out_b, "--stop-after", "6"],
                          env=env, timeout=240)
    before = _losses(stopped.output)
    assert sorted(before) == list(range(1, 7)), stopped.output
    for step in range(1, 7):  # same vocabulary, data, masks: the same run so far
        assert abs(before[step] - losses[step]) <= 1e-6, (step, before[step], losses[step])
    assert not (tmp_path / "b" / "model").exists()
    resumed = run_workers("torchrun", 2, SCRIPT, args=[*TINY, *out_b[:2], "--resume"],
                          env=env, timeout=240)
    assert "resumed from" in resumed.output and "at step 6" in resumed.output, resumed.output
    again = _losses(resumed.output)
    assert sorted(again) == list(range(7, 13)), resumed.output
    for step in range(7, 13):
        assert abs(again[step] - losses[step]) <= 1e-6, (step, again[step], losses[step])


def test_help_and_bad_flags() -> None:
    ok = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    for flag in ("--accumulation", "--compression", "--bf16", "--resume", "--checkpoint-every"):
        assert flag in ok.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--compression", "int8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr


def test_a_missing_dependency_names_the_package_and_the_command(tmp_path: Path) -> None:
    # A directory on sys.path whose "transformers" fails to import, as if absent.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'transformers'\")\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1"], capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(tmp_path),
                                                      "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    assert "transformers" in proc.stderr and "pip install 'transformers==" in proc.stderr


def test_the_trained_tokenizer_is_kept_and_reused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bert_pretrain_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    texts, cache = example.corpus()[:300], tmp_path / "cache"
    first = example.cached_tokenizer(texts, 300, cache)
    kept = list(cache.glob("bert-wordpiece-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == first and '"[CLS]"' in first
    kept[0].write_text(first.replace('"[CLS]"', '"[KEPT]"'))  # the next run reads, not trains
    assert '"[KEPT]"' in example.cached_tokenizer(texts, 300, cache)
    example.cached_tokenizer(texts, 200, cache)  # another vocabulary size: a file of its own
    assert len(list(cache.glob("bert-wordpiece-*.json"))) == 2
    assert not list(cache.glob("*.part"))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert '"[CLS]"' in example.cached_tokenizer(texts, 300, blocked)  # trained, not kept
    assert f"--tokenizer-cache {blocked}: not kept" in capsys.readouterr().out
