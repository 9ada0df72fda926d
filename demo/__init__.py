"""Demo models for modelplane: build small checkpoints and register them in MLflow."""
