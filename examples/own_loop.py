"""Your own training loop, kept as it is, surviving faults in place.

A plain PyTorch loop (a model with dropout, AdamW with a cosine schedule, scikit-learn's
handwritten digits) with five ElasWave lines. Run it on 3 workers, one killed at step 8::

    elaswave launch --script examples/own_loop.py --nproc-per-node 3 --steps 30 \\
        --global-batch 48 --micro-batch-size 8 --max-restarts 1 --fault kill,rank=1,at_step=8

The survivors never restart; the killed rank's replacement runs this file from the top, and
``register`` fills its model and optimizer from its peers; every step is committed once, with the
same 48 samples whatever the world size.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from own_model import DigitImages
from torch import nn

import elaswave


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--t-max", type=int, help="cosine schedule's steps (default: the job's)")
    args = parser.parse_args()

    job = elaswave.init()  # joins the job; seeds torch alike on every rank
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, args.width), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(args.width, 10),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.t_max or job.total_steps
    )
    # The script's own state, kept by ElasWave too: an average of the weights (what a newcomer
    # could not recompute) and the samples trained on.
    state = {"ema": [p.detach().clone() for p in model.parameters()], "samples": 0}
    job.register(model, optimizer, scheduler, state=state)

    for step in job.steps(dataset=DigitImages()):
        for mb in step.micro_batches():  # this rank's share of the step's global batch
            logits = model(mb.inputs)
            loss = F.cross_entropy(logits, mb.targets, reduction="sum")
            step.backward(loss, count=mb.size)
        if step.commit():  # reduced over every rank, then AdamW and the schedule
            for avg, p in zip(state["ema"], model.parameters(), strict=True):
                avg.lerp_(p.detach(), 0.1)
            state["samples"] += job.global_batch
            job.log(train_loss=step.loss)
            if job.rank == 0 and step.index % 10 == 0:
                print(f"step {step.index}: loss {step.loss:.4f}", flush=True)
    job.finish()


if __name__ == "__main__":
    main()
