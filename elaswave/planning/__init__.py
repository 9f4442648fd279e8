"""Pure decisions, no I/O: plans, pipeline plans, layer partition, DVFS policy, shard layouts,
schedules and verdicts (table-tested)."""
