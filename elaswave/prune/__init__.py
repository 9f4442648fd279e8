"""Structured pruning during training: zero-invariant groups, DHSPG, compression."""
