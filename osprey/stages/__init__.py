"""The method's stages: pruning a model into a backbone (`osprey prune`), converting a backbone into a drafter for a
target (`osprey convert`, with its vocabulary alignment and the per-family presets) and the controls Osprey is
measured against (`osprey baseline`).

May import `osprey.ground` and `osprey.models`; never `osprey.decoding`, `osprey.measuring` or `osprey.serving`.
"""
