"""Benchmark cases: each module defines ``CASES: list[Case]`` (see dsa/bench/case.py)."""
