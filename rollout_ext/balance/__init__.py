"""Tail-aware load balancing: pure-Python policy, length predictor, simulator."""
