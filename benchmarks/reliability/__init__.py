"""The reliability report: faults injected into a running platform, every request counted.

``python -m benchmarks.reliability [--quick] [--only NAME ...] --json OUT.json`` runs the fault
table (``table``) on one platform (``bed``), each fault with a request loop in a process of
its own (``requestloop``), and prints, per fault, the requests sent, answered, refused,
failed and lost, the time to detect and the time to recover. ``tests/test_faults.py`` runs
the same table and fails on any fault that misses its required result (``make test-faults``).
"""
