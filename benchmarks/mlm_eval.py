"""Masked-LM loss of finished BERT example runs, on the same masked
sequences for every run: a steadier comparison of runs than the example's
own summary (the mean of its last 10 training steps' losses, each on
another batch with other masks).

Each run directory is an ``--output-dir`` of ``examples/bert_pretrain.py``
that ran to its last step (it holds ``model/`` and ``tokenizer.json``).
The loss is the mean over the first ``--sequences`` sequences of the
corpus, masked with ``--seed`` (15% of tokens, as in training), in
evaluation mode. Each model reads the corpus through its own run's
tokenizer: the example trains one per run, and the tokenizers library's
WordPiece training breaks ties differently from one process to the next
(two runs' vocabularies differ in a few dozen of their 4,096 tokens), so
the sequences are the same text cut and masked alike, not the same ids.

    # e.g. plain against PowerSGD at rank 4, 300 steps each:
    torchrun --nproc_per_node 2 examples/bert_pretrain.py --steps 300 \\
        --checkpoint-every 0 --no-progress --output-dir runs/plain
    torchrun --nproc_per_node 2 examples/bert_pretrain.py --steps 300 \\
        --checkpoint-every 0 --no-progress --powersgd-rank 4 --output-dir runs/psgd4
    python benchmarks/mlm_eval.py runs/plain runs/psgd4
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any


def load_example() -> object:
    path = Path(__file__).resolve().parents[1] / "examples" / "bert_pretrain.py"
    spec = importlib.util.spec_from_file_location("bert_pretrain", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path,
                    help="output directories; the first is the anchor")
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import (
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    example = load_example()
    texts = example.corpus()

    def masked(run: Path, seq_len: int) -> list[dict[str, Any]]:
        raw = Tokenizer.from_str((run / "tokenizer.json").read_text())
        blocks = example.make_blocks(raw, texts, seq_len)[:args.sequences]
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]", model_max_length=seq_len)
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
        torch.manual_seed(args.seed)
        return [collator(blocks[i:i + args.batch]) for i in range(0, len(blocks), args.batch)]

    print(f"the first {args.sequences} sequences of the corpus, masked with seed {args.seed}\n")
    print("| run | masked-LM loss | vs first |")
    print("|---|---:|---:|")
    anchor = None
    for run in args.runs:
        model = BertForMaskedLM.from_pretrained(run / "model").eval()
        total = count = 0.0
        with torch.no_grad():
            for batch in masked(run, model.config.max_position_embeddings):
                n = int((batch["labels"] != -100).sum())
                total += float(model(**batch).loss) * n
                count += n
        loss = total / count
        anchor = loss if anchor is None else anchor
        print(f"| {run} | {loss:.4f} | {100 * (loss / anchor - 1):+.1f}% |")


if __name__ == "__main__":
    main()
