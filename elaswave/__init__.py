"""ElasWave: elastic-native hybrid-parallel training that survives faults in place.

The public seam for your own model: ``from elaswave import Workload, TensorSpec`` (see
:mod:`elaswave.runtime.workload.base`). It is imported on first use, so the command line does not
pay for torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Dataset", "ParamRef", "TensorSpec", "Workload"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elaswave.runtime.workload import base

        return getattr(base, name)
    raise AttributeError(f"module 'elaswave' has no attribute {name!r}")
