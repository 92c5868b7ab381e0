"""Test doubles built on the real components, for tests, benchmarks and demos (never used by a training run)."""
