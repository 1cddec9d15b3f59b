"""The store: where a vault's bytes live, and the files that say what the folder is.

A vault is a folder, or an fsspec URL prefix, of immutable files. Every other part of the
vault reads and writes through :class:`~.backend.Store`, so nothing above this folder knows
whether the bytes are local.

Parts, in the order a save calls them:

- :mod:`.backend`: the :class:`~.backend.Store` (a local folder or any fsspec filesystem),
  with atomic writes (a temporary name, then a rename) and positional reads.
- :mod:`.identity`: ``vault.json``, which makes a folder a vault and names its version.
- :mod:`.seal`: the xxh3-128 ``"sum"`` that ends every small JSON file of a vault
  (records, intents, pack indexes, ``vault.json``).
- :mod:`.lease`: leases, files that say which process holds a piece of work (a running
  gc, which a save waits for; the compactor) and whether it still does.
- :mod:`.pack`: pack files, many objects in one file behind a sealed index.
"""
