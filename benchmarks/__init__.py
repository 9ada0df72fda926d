"""Reproducible benchmarks: each runs modelplane and its anchor side by side and writes JSON."""
