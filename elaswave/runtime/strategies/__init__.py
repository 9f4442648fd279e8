"""How a rank trains: the strategy interface (base), replicated data parallelism (replicated),
ZeRO-1 (sharded, over the shard state in zero), pipeline stages (pipeline/), and the choice
(select)."""
