"""dsa-bench: the benchmark harness (run ``python -m dsa.bench --help``)."""
