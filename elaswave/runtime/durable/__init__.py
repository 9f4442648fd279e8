"""Durable state: checkpoints on disk (checkpoints)."""
