"""A pipeline stage: the 1F1B step, layer migration, ZeRO-1 inside the stages, clocks and timing."""
