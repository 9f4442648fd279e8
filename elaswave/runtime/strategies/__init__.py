"""How a rank trains: ZeRO-1 (zero) and pipeline stages (pipeline/); replicated data
parallelism lives in the engine."""
