"""For every test: jobs train on the CPU, on any machine. ``train.device`` defaults to an
accelerator where there is one, and the tests' jobs assume CPU workers (four on one host, gloo);
the GPU tests (``-m gpu``) ask for ``--device cuda`` themselves, which wins over this."""

from __future__ import annotations

import os

os.environ.setdefault("ELASWAVE_TRAIN__DEVICE", "cpu")
