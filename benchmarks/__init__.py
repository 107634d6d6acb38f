"""Benchmark scripts (run from the repository root); the reference blocks they share with the tests: tests/blocks.py."""
