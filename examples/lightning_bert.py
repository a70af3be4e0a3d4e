"""examples/bert_pretrain.py's masked-LM job as a LightningModule, strategy="horovod".

The corpus, tokenizer, sequences and flags are bert_pretrain.py's (imported);
what changes is the training loop: Lightning's, with dp_plugin's strategy.
``--accumulation``, ``--clip-norm`` and ``--bf16`` become the Trainer's
``accumulate_grad_batches``, ``gradient_clip_val`` and ``precision``; the
checkpoint flags of bert_pretrain.py are not used here. Launch unchanged::

    torchrun --nproc_per_node 2 examples/lightning_bert.py --steps 50
    horovodrun --gloo -np 2 -H localhost:2 python examples/lightning_bert.py --steps 50
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bert_pretrain as job

job.require({**job.REQUIRED, "lightning": "lightning==2.6.0"})
import lightning as L  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

import dp_plugin.lightning  # noqa: E402, F401 - registers strategy="horovod"


class MaskedLM(L.LightningModule):
    def __init__(self, args: Any, vocab_size: int, pad_id: int) -> None:
        super().__init__()
        self.args = args
        self.bert = BertForMaskedLM(BertConfig(
            vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, intermediate_size=args.intermediate,
            max_position_embeddings=args.seq_len, pad_token_id=pad_id))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.bert(**batch).loss
        self.log("loss", loss, sync_dist=True)  # the mean over ranks
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.global_step
        if self.trainer.is_global_zero and step % self.args.log_every == 0 and \
                (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            print(f"step {step} loss {self.trainer.callback_metrics['loss']:.6f}", flush=True)

    def configure_optimizers(self) -> Any:
        no_decay = ("bias", "LayerNorm.weight")
        params = list(self.named_parameters())
        opt = torch.optim.AdamW([
            {"params": [p for n, p in params if not n.endswith(no_decay)],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in params if n.endswith(no_decay)], "weight_decay": 0.0},
        ], lr=self.args.lr)
        schedule = get_linear_schedule_with_warmup(opt, self.args.warmup_steps, self.args.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(argv: list[str] | None = None) -> None:
    args = job.parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    trainer = L.Trainer(
        strategy="horovod", max_steps=args.steps, accumulate_grad_batches=args.accumulation,
        gradient_clip_val=args.clip_norm or None, precision="bf16-mixed" if args.bf16 else None,
        logger=False, enable_checkpointing=False, enable_progress_bar=not args.no_progress)
    size = trainer.world_size
    texts = job.corpus()  # the tokenizer is trained once, on rank 0, and sent to every rank
    tok_json = None
    if trainer.is_global_zero:
        tok_json = (args.tokenizer.read_text() if args.tokenizer
                    else job.train_tokenizer(texts, args.vocab_size).to_str())
    raw = Tokenizer.from_str(trainer.strategy.broadcast(tok_json))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=args.seq_len)
    loader = torch.utils.data.DataLoader(
        job.make_blocks(raw, texts, args.seq_len), shuffle=True, drop_last=True,
        batch_size=args.global_batch // (size * args.accumulation),
        collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability))
    trainer.fit(MaskedLM(args, raw.get_vocab_size(), raw.token_to_id("[PAD]")), loader)


if __name__ == "__main__":
    main()
