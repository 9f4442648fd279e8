"""Workloads: the public seam between the runtime and a model (:mod:`.base`), the built-in GPT
(:mod:`.gpt`) and the loader that picks one from a job config (:mod:`.load`)."""

from elaswave.runtime.workload.base import (
    Dataset,
    KeyedLayers,
    TensorSpec,
    Workload,
    build_layer,
    build_layers,
    call_layer,
    layer_seed,
)

__all__ = [
    "Dataset",
    "KeyedLayers",
    "TensorSpec",
    "Workload",
    "build_layer",
    "build_layers",
    "call_layer",
    "layer_seed",
]
