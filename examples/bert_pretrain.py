"""BERT-style masked-language-model pretraining, data parallel with dp_plugin.

The README's main job (``make train``). A ``transformers.BertForMaskedLM``
built from a small ``BertConfig`` (random weights: nothing is downloaded)
learns masked-token prediction on real English text that ships with Python
itself: the reference documentation in the standard library's
``pydoc_data.topics`` module (the text ``help("if")`` shows, ~460 kB). A
WordPiece tokenizer is trained on that text first with ``tokenizers``.

The distributed part is Horovod's recipe, line for line::

    import dp_plugin.torch as hvd
    hvd.init()
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=accum, compression=...)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Launch it unchanged under any of::

    torchrun --nproc_per_node 2 examples/bert_pretrain.py
    horovodrun --gloo -np 2 -H localhost:2 python examples/bert_pretrain.py
    mpirun -n 2 python examples/bert_pretrain.py

Rank 0 shows a progress bar (loss, tokens/s, share of the gradient
communication hidden behind backward) and writes an atomic checkpoint every
``--checkpoint-every`` steps; ``--resume`` continues from it on every rank
with the same model, optimizer, LR schedule, RNG states and data position, so
the loss continues exactly as if the run had never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

# Before tokenizers is imported: its thread pool and fork() do not mix.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REQUIRED = {
    # import name: pip requirement (pinned in requirements.txt)
    "torch": "torch==2.13.0",
    "transformers": "transformers==5.23.0",
    "tokenizers": "tokenizers==0.23.3",
    "tqdm": "tqdm==4.70.1",
}
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def require(names: dict[str, str]) -> None:
    """Exit with a message naming the package and the command that installs it."""
    missing = []
    for module, requirement in names.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append((module, requirement, exc))
    if missing:
        lines = [f"  {m}: {exc}  ->  pip install '{r}'" for m, r, exc in missing]
        pins = " ".join(f"'{r}'" for _, r, _ in missing)
        raise SystemExit(
            f"{Path(sys.argv[0]).name} needs packages that are not installed:\n"
            + "\n".join(lines)
            + f"\nInstall them with `pip install {pins}` (or `make install`, which pins "
            "everything in requirements.txt)."
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Masked-LM pretraining of a small BERT on the Python docs, data parallel "
                    "with dp_plugin (torchrun / horovodrun / mpirun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("model (BertConfig; random initialization)")
    g.add_argument("--layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden", type=int, default=256, help="hidden size")
    g.add_argument("--heads", type=int, default=4, help="attention heads (must divide --hidden)")
    g.add_argument("--intermediate", type=int, default=0,
                   help="feed-forward size; 0 means 4 x --hidden")
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="WordPiece vocabulary size trained on the corpus")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, [CLS]/[SEP] in")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer.json to use instead of the trained one")
    g.add_argument("--tokenizer-cache", default=str(default_cache()),
                   help="where the trained tokenizer is kept, one per corpus and vocabulary "
                        "size, so that every run starts from the same vocabulary (WordPiece "
                        "training breaks frequency ties differently from process to process); "
                        "an empty string trains afresh each run")
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=150, help="optimizer steps in the whole run")
    g.add_argument("--global-batch", type=int, default=32,
                   help="sequences per optimizer step over all workers; each worker takes "
                        "global-batch / (workers x accumulation) per backward pass")
    g.add_argument("--accumulation", type=int, default=1,
                   help="backward passes per optimizer step (backward_passes_per_step)")
    g.add_argument("--lr", type=float, default=1e-3,
                   help="peak AdamW learning rate for --global-batch (not rescaled by the "
                        "number of workers: the global batch is fixed)")
    g.add_argument("--warmup-steps", type=int, default=15,
                   help="linear warmup from 0 to --lr, then linear decay to 0 at --steps")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (not on biases and LayerNorm weights)")
    g.add_argument("--clip-norm", type=float, default=1.0,
                   help="clip the averaged gradient's global norm (0: no clipping)")
    g.add_argument("--mlm-probability", type=float, default=0.15,
                   help="share of tokens selected for prediction (80%% [MASK], 10%% random, "
                        "10%% unchanged)")
    g.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="wire type of the gradient all-reduce")
    g.add_argument("--powersgd-rank", type=int, default=0,
                   help="reduce gradients with PowerSGD at this rank (0: off; "
                        "dp_plugin.torch.powersgd, docs/torch.md)")
    g.add_argument("--bf16", action="store_true",
                   help="run forward and loss under torch.autocast(bfloat16)")
    g.add_argument("--seed", type=int, default=42, help="seed of model init, data order, masks")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker; 0 means cores / local workers")
    g = ap.add_argument_group("checkpoints and output")
    g.add_argument("--output-dir", type=Path, default=Path("runs/bert"),
                   help="tokenizer, checkpoint and final model go here")
    g.add_argument("--checkpoint-every", type=int, default=50,
                   help="save an atomic checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", action="store_true",
                   help="continue from <output-dir>/checkpoint.pt (same flags as the first run)")
    g.add_argument("--stop-after", type=int, default=0,
                   help="leave after this step, with a checkpoint, as a time-limited job "
                        "would; the schedule still spans --steps (0: run to --steps)")
    g.add_argument("--log-every", type=int, default=10,
                   help="print a 'step N loss X' line every N steps (rank 0)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--report-digest", action="store_true",
                   help="at the end every rank prints a SHA-256 of its parameters: equal "
                        "digests show the ranks hold the same model")
    args = ap.parse_args(argv)
    if args.intermediate == 0:
        args.intermediate = 4 * args.hidden
    for name in ("layers", "hidden", "heads", "vocab_size", "steps", "global_batch",
                 "accumulation", "log_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.hidden % args.heads:
        ap.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        ap.error(f"--tokenizer {args.tokenizer}: no such file")
    if args.seq_len < 8:
        ap.error(f"--seq-len must be >= 8, got {args.seq_len}")
    if not 0.0 < args.mlm_probability < 1.0:
        ap.error(f"--mlm-probability must be in (0, 1), got {args.mlm_probability}")
    return args


# -- data ---------------------------------------------------------------------------

def corpus() -> list[str]:
    """Paragraphs of the Python reference documentation shipped in the stdlib."""
    from pydoc_data import topics

    paragraphs = []
    for key in sorted(topics.topics):
        for block in topics.topics[key].split("\n\n"):
            text = " ".join(line.strip() for line in block.splitlines() if line.strip())
            # Keep prose; skip rule lines ("*****") and bare grammar productions.
            if len(text) >= 40 and not set(text) <= set("*=-~^ "):
                paragraphs.append(text)
    return paragraphs


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/dp_plugin`` (``~/.cache/dp_plugin`` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dp_plugin"


def cached_tokenizer(texts: list[str], vocab_size: int, cache: Path | None) -> str:
    """The tokenizer (JSON) trained on ``texts``: from ``cache`` when a run
    on this corpus, vocabulary size and tokenizers release trained it
    before, else trained now and kept there (written whole, then renamed,
    so concurrent runs never read half a file). Without a cache, or one
    that cannot be written, it is trained afresh."""
    import tokenizers

    key = hashlib.sha256(f"{tokenizers.__version__}\n{vocab_size}\n".encode())
    key.update("\n".join(texts).encode())
    path = None if cache is None else cache / f"bert-wordpiece-{key.hexdigest()[:16]}.json"
    if path is not None and path.is_file():
        return path.read_text()
    tok_json = train_tokenizer(texts, vocab_size).to_str()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{os.getpid()}.part")
            part.write_text(tok_json)
            os.replace(part, path)
        except OSError as exc:
            print(f"--tokenizer-cache {cache}: not kept ({exc}); the next run trains again",
                  flush=True)
    return tok_json


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A BERT-style (uncased) WordPiece tokenizer trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                               min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def make_blocks(tokenizer: Any, texts: list[str], seq_len: int) -> list[dict[str, Any]]:
    """run_mlm.py's "group_texts": concatenate all token ids and cut them into
    [CLS] block [SEP] sequences of exactly ``seq_len`` tokens."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    body = seq_len - 2
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    return [{"input_ids": [cls, *ids[i:i + body], sep]}
            for i in range(0, len(ids) - body + 1, body)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require(REQUIRED)
    import torch
    from tokenizers import Tokenizer
    from torch.utils.data.distributed import DistributedSampler
    from tqdm import tqdm
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
        get_linear_schedule_with_warmup,
    )
    from transformers.utils import logging as hf_logging

    import dp_plugin.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hf_logging.set_verbosity_error()
    per_pass = args.global_batch // (size * args.accumulation)
    if per_pass * size * args.accumulation != args.global_batch:
        raise SystemExit(
            f"--global-batch {args.global_batch} is not divisible by {size} workers x "
            f"--accumulation {args.accumulation}; pick a multiple of {size * args.accumulation}"
        )
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    out: Path = args.output_dir
    ckpt_path = out / "checkpoint.pt"
    if args.resume and rank == 0 and not ckpt_path.exists():
        print(f"--resume: no checkpoint at {ckpt_path}; starting from step 0", flush=True)
    resume = hvd.broadcast_object(args.resume and ckpt_path.exists(), root_rank=0,
                                  name="resume?")

    # Tokenizer: trained by rank 0, sent to all, so every rank has the same vocabulary.
    texts = corpus()
    tok_json = None
    if rank == 0:
        tok_file = out / "tokenizer.json"
        if args.tokenizer is not None:
            tok_json = args.tokenizer.read_text()
            out.mkdir(parents=True, exist_ok=True)
            tok_file.write_text(tok_json)
        elif resume and tok_file.exists():  # the vocabulary the checkpoint was trained with
            tok_json = tok_file.read_text()
        else:
            cache = Path(args.tokenizer_cache) if args.tokenizer_cache else None
            tok_json = cached_tokenizer(texts, args.vocab_size, cache)
            out.mkdir(parents=True, exist_ok=True)
            tok_file.write_text(tok_json)
    tok_json = hvd.broadcast_object(tok_json, root_rank=0, name="tokenizer")
    raw_tok = Tokenizer.from_str(tok_json)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=args.seq_len,
    )
    dataset = make_blocks(raw_tok, texts, args.seq_len)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True,
                                               mlm_probability=args.mlm_probability)
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    passes_per_epoch = len(sampler) // per_pass
    if passes_per_epoch < args.accumulation:
        raise SystemExit(f"the corpus has {len(dataset)} sequences: too few for a global "
                         f"batch of {args.global_batch}")

    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=raw_tok.get_vocab_size(), hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=args.intermediate, max_position_embeddings=args.seq_len,
        pad_token_id=raw_tok.token_to_id("[PAD]"),
    )
    model = BertForMaskedLM(config)
    model.train()
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        backward_passes_per_step=args.accumulation,
        compression={"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                     "bf16": hvd.Compression.bf16}[args.compression],
    )
    if args.powersgd_rank:
        from dp_plugin.torch.powersgd import PowerSGDHook

        opt.register_comm_hook(PowerSGDHook(rank=args.powersgd_rank))
    schedule = get_linear_schedule_with_warmup(opt, args.warmup_steps, args.steps)

    step, epoch, position = 0, 0, 0  # position: backward passes done in this epoch
    if resume:
        state = hvd.load_checkpoint(ckpt_path)  # every rank; restores its RNG states
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        step, epoch, position = state["step"], state["epoch"], state["position"]
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step} (epoch {epoch}, "
                  f"pass {position})", flush=True)
    else:
        torch.manual_seed(args.seed + 1000 * (rank + 1))  # per-rank masks and dropout
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    def save() -> None:
        hvd.save_checkpoint(ckpt_path, model=model.state_dict(), optimizer=opt.state_dict(),
                            scheduler=schedule.state_dict(), step=step, epoch=epoch,
                            position=position)

    last = min(args.steps, args.stop_after) if args.stop_after else args.steps
    tokens_per_step = args.global_batch * args.seq_len
    bar = None
    if rank == 0 and not args.no_progress:
        bar = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True,
                   file=sys.stderr, desc=f"bert x{size}")
    losses: list[float] = []
    t_start = time.perf_counter()
    t_window, step_window = t_start, step
    sampler.set_epoch(epoch)
    order = list(iter(sampler))
    while step < last:
        loss_sum = torch.zeros(())
        for _ in range(args.accumulation):
            if position >= passes_per_epoch:
                epoch, position = epoch + 1, 0
                sampler.set_epoch(epoch)
                order = list(iter(sampler))
            idx = order[position * per_pass:(position + 1) * per_pass]
            position += 1
            batch = collator([dataset[i] for i in idx])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(**batch).loss / args.accumulation
            loss.backward()
            loss_sum += loss.detach().float()
        opt.synchronize()
        if args.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        with opt.skip_synchronize():
            opt.step()
        schedule.step()
        opt.zero_grad()
        step += 1
        mean_loss = hvd.allreduce(loss_sum, op=hvd.Average, name="loss").item()
        losses.append(mean_loss)
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or step == last:
            save()
        if rank == 0:
            now = time.perf_counter()
            if bar is not None:
                bar.update(1)
                if step % 5 == 0 or step == last:
                    rate = (step - step_window) * tokens_per_step / max(now - t_window, 1e-9)
                    t_window, step_window = now, step
                    bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{rate:,.0f}",
                                    hidden=hidden_share(opt), refresh=False)
            if step % args.log_every == 0 or step == last:
                line = (f"step {step} loss {mean_loss:.6f} lr {schedule.get_last_lr()[0]:.2e}")
                (bar.write if bar is not None else print)(line)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    if rank == 0 and losses:
        head = sum(losses[:10]) / len(losses[:10])
        tail = sum(losses[-10:]) / len(losses[-10:])
        if step >= args.steps:
            model.save_pretrained(out / "model")
            tokenizer.save_pretrained(out / "model")
        print(
            f"summary: workers {size}, steps {step - len(losses) + 1}-{step}, loss "
            f"{head:.3f} (first 10) -> {tail:.3f} (last 10), "
            f"{len(losses) * tokens_per_step / wall:,.0f} tokens/s, "
            f"communication hidden {hidden_share(opt)}, {wall:.1f}s, "
            f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
            f"checkpoint {ckpt_path}",
            flush=True,
        )
    if args.report_digest:
        digest = hashlib.sha256()
        for tensor in model.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        print(f"parameters sha256 {digest.hexdigest()[:16]} (rank {rank} of {size})", flush=True)
    hvd.shutdown()


def hidden_share(opt: Any) -> str:
    """Share of the gradient all-reduce time that overlapped backward (recent steps)."""
    history = opt.comm_stats()
    if history is None:
        return "n/a (1 worker)"
    recent = list(history)[-20:]
    total = sum(s.allreduce_s for s in recent)
    exposed = sum(min(s.exposed_s, s.allreduce_s) for s in recent)
    if total <= 0:
        return "n/a"
    return f"{100.0 * (1.0 - exposed / total):.0f}%"


if __name__ == "__main__":
    main()
