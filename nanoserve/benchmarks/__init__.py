"""Benchmarks that ship with the package: `nanoserve bench throughput|serving` (also bench/*.py)."""
