"""ElasWave: elastic-native hybrid-parallel training that survives faults in place.

Two public seams, imported on first use (the command line does not pay for torch):

- your own training loop: ``job = elaswave.init()`` in a script run by ``elaswave launch
  --script FILE`` (see :mod:`elaswave.runtime.loop`);
- your own model as a workload of a config job: ``from elaswave import Workload, TensorSpec``
  (see :mod:`elaswave.runtime.workload.base`).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Dataset", "ParamRef", "ScriptError", "TensorSpec", "Workload", "init"]

_LOOP = ("init", "ScriptError")


def __getattr__(name: str) -> Any:
    if name in _LOOP:
        from elaswave.runtime import loop

        return getattr(loop, name)
    if name in __all__:
        from elaswave.runtime.workload import base

        return getattr(base, name)
    raise AttributeError(f"module 'elaswave' has no attribute {name!r}")
