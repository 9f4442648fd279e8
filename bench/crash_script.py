"""``python -m bench crash``'s own-loop system: the job's model (the config's, built as a plain
module) trained by a user's loop under ``elaswave launch --script``: the same work as the
engine's run of that config, driven from a script."""

from __future__ import annotations

import torch

import elaswave
from elaswave.runtime.workload.load import build_model, load_workload


def main() -> None:
    job = elaswave.init()
    t = job.cfg.train  # the job's config names the model; a user's script would build its own
    model = build_model(job.cfg)
    workload = load_workload(job.cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)  # fmt: skip
    job.register(model, opt)
    data = workload.dataset(t.seed)
    for step in job.steps(dataset=data, collate=workload.collate):
        for mb in step.micro_batches():
            loss, count = workload.loss(model(mb.inputs, step.index, mb.id), mb.targets)
            step.backward(loss, count=int(count))
        step.commit()
    job.finish()


if __name__ == "__main__":
    main()
