"""The router: one front door for every endpoint (auth, balancing, retries, streaming)."""
