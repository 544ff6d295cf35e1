"""Measuring: the benchmark harness (`osprey bench`), its prompt suites and report, and `osprey demo`.

May import `osprey.ground`, `osprey.models`, `osprey.stages` and `osprey.decoding`; never `osprey.serving`.
"""
