"""Benchmarks. Each prints its figure beside a reference measured in the same run."""
