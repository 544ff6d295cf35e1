"""Decoding and its checks: speculative decoding and the target alone (`osprey decode`), and the output check
(`near_tie`: an audit of every token and a replay of the first differing one) that tells a rounding difference from a
decoding bug.

May import `osprey.ground` and `osprey.models`; never `osprey.stages`, `osprey.measuring` or `osprey.serving`.
"""
