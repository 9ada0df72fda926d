"""Evaluating a served checkpoint on the real engine, and the eval gate's decision."""
