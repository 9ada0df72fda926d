"""Where replicas run: the Cluster Protocol, an in-memory fake, and the local process backend."""
