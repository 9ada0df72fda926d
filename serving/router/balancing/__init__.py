"""Balancing plugins: filters drop replicas, scorers rank them, a picker chooses (no I/O)."""
