"""Benchmark harness (`python -m bench.run`) and its recorded results (bench/RESULTS.md)."""
