"""ZeRO: one shard state (:mod:`.state`) and the pieces a mode combines around it: where the
parameters live (:mod:`.holding`), how a step's gradient reaches the shard (:mod:`.update`), the
layer-wise data path (:mod:`.layerpath`, :mod:`.gather`), which ranks the shards span and how
they reach a new layout (:mod:`.scopes`, :mod:`.reshard`), replicas and repair
(:mod:`.replicas`). The strategies themselves are in :mod:`.strategy`."""

from elaswave.runtime.strategies.zero.shard import Shard, ShardLost, Staged

__all__ = ["Shard", "ShardLost", "Staged"]
