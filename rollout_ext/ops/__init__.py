"""Device-neutral operations: a pure-torch reference beside each NPU implementation."""
