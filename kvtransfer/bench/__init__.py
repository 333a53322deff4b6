"""Benchmarks for KV transfer and the reference ceilings they are reported against."""
