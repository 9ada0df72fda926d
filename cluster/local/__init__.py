"""The local cluster backend: replicas are processes on this machine, run by a supervisor."""
