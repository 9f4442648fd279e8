"""A plain Hugging Face training loop (a small Llama, random init: nothing downloads), kept as it
is and run elastically::

    elaswave launch --script examples/own_loop_hf.py --nproc-per-node 3 --steps 20 \\
        --global-batch 24 --micro-batch-size 4 --max-restarts 1 --fault kill,rank=1,at_step=5

The data is a map-style set of token sequences (here a seeded synthetic one; a tokenized corpus
works the same); the loss is the sum over the micro-batch's target tokens, and its count the
number of those tokens, so the step's gradient is the mean over every token of the global batch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import elaswave


class Tokens(torch.utils.data.Dataset):
    """``count`` sequences of ``length + 1`` tokens with a learnable pattern (each token the one
    before it plus a per-sequence stride)."""

    def __init__(self, vocab: int, length: int, count: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (count, 1), generator=g)
        stride = torch.randint(1, 4, (count, 1), generator=g)
        self.data = (start + stride * torch.arange(length + 1)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    job = elaswave.init()
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.length,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    job.register(model, optimizer, warmup)

    for step in job.steps(dataset=Tokens(args.vocab, args.length)):
        for mb in step.micro_batches():
            logits = model(input_ids=mb.inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
            step.backward(loss, count=mb.targets.numel())
        if step.commit() and job.rank == 0 and step.index % 5 == 0:
            print(f"step {step.index}: loss {step.loss:.4f}", flush=True)
    job.finish()


if __name__ == "__main__":
    main()
