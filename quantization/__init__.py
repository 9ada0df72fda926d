"""Weight quantization of LLM checkpoints: the plan (pure), the worker (in ``.venv-quantize``), the checks.

Nothing in this package imports modelplane's main environment: ``worker.py`` runs in the
quantization environment (llmcompressor) through Dagster Pipes, with this repository on
``PYTHONPATH``, and imports ``plan`` and ``reconstruction`` from here.
"""
