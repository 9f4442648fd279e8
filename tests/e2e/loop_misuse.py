"""A script run by ``elaswave launch --script`` that uses the loop's API wrongly, one way per
``--misuse``: each must end the job with one line that names the rank and the cause."""

from __future__ import annotations

import argparse

import torch
from torch import nn

import elaswave

parser = argparse.ArgumentParser()
parser.add_argument("--misuse", required=True)
misuse = parser.parse_args().misuse

job = elaswave.init()
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
job.register(model, optimizer)
if misuse == "register-twice":
    job.register(model, optimizer)
data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
for step in job.steps(dataset=data):
    for mb in step.micro_batches():
        out = model(mb.inputs)
        if misuse == "raise" and step.index == 3:
            raise ValueError("boom in the user's loop")
        loss = nn.functional.cross_entropy(out, mb.targets, reduction="none")
        step.backward(loss if misuse == "vector-loss" else loss.sum())
    if misuse != "no-commit":
        step.commit()
job.finish()
