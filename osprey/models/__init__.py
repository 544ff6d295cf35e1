"""Models and publishing: the zoo (fetching and loading models by zoo name, directory or Hub id; the shipped
backbones), the compact format of zoo weights, the drafter loader and packed format, the model card and `osprey push`.

May import `osprey.ground` and floor 0 (`modeling_osprey`); nothing else of `osprey`.
"""
