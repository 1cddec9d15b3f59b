"""Upkeep: work on a vault after its saves have committed.

None of it changes what any checkpoint loads; each part only changes how it is stored or
finds what is wrong.

- :mod:`.compactor`: the thread of one :class:`~weightvault.Vault` that runs compaction
  after each save.
- :mod:`.compact`: compression and deltas, under a lock, one checkpoint at a time.
- :mod:`.retain`: dropping checkpoints or their training state.
- :mod:`.gc`: freeing objects no checkpoint or intent references.
- :mod:`.verify`: checking everything a load would refuse, reported, never raised.
"""
