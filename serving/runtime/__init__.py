"""The server inside each replica, chosen from the model's flavor (vLLM or pyfunc)."""
