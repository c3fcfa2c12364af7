"""Helpers for tests and benchmarks: tiny random-weight checkpoints."""
