"""Decoding and its checks: speculative decoding and the target alone (`osprey decode`), and the near-tie replay that
tells a rounding difference from a wrong verifier.

May import `osprey.ground` and `osprey.models`; never `osprey.stages`, `osprey.measuring` or `osprey.serving`.
"""
