"""How a rank trains: the strategy interface (base), the step's sums (sums), the whole-model data
path (wholemodel), replicated data parallelism (replicated), ZeRO-1 and ZeRO-3 as choices of
pieces around one shard state (zero/), pipeline stages (pipeline/), and the choice (select)."""
