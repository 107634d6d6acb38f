"""Benchmark scripts and the reference blocks they share with the tests (:mod:`benchmarks.blocks`)."""
