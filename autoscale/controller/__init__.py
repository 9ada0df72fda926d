"""The autoscaler controller: the one part of ``autoscale`` that does I/O.

:mod:`.loop` gathers signals, calls the pure policies and applies their decisions;
:mod:`.sources` reads the stores, the routers and the replicas; ``python -m
autoscale.controller`` is the process ``modelplane up`` starts.
"""
