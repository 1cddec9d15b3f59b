"""Upkeep: work on a vault after its saves have committed.

None of it changes what any checkpoint loads; each part only changes how it is stored or
finds what is wrong.

In calling order:

- :mod:`.compactor`: the thread of one :class:`~weightvault.Vault` that runs compaction
  after each save.
- :mod:`.compact`: one compaction pass, compression and deltas, one checkpoint at a
  time; it calls, in turn:

  - :mod:`.compact_lease`: the lease that lets one compactor work on a vault at a time;
  - :mod:`.records_cache`: the checkpoints, oldest first, and their tensors, read once
    per pass;
  - :mod:`.policy`: which objects of a checkpoint become full and which deltas, and
    keeping the oldest and the newest whole;
  - :mod:`.probes`: what an object's frame header says of its chain;
  - :mod:`.reencode`: verified raw bytes re-encoded, staged under an intent, published;
  - :mod:`.unpack`: objects taken out of pack files, written loose;
  - :mod:`.report`: what the pass did.

- :mod:`.retention`: which checkpoints a vault deletes, and whose training state it
  drops, sparing what a mirror has not pushed yet (:mod:`.sparing`); it calls
  :mod:`.retain` to drop training state and :mod:`.ends` to leave the new ends to the
  compactor.
- :mod:`.pacing`: a gc after every save that never takes more than a share of a loop's
  time.
- :mod:`.gc`: freeing objects no checkpoint or intent references, under a gc lease
  (:mod:`..store.lease`); it finds what is live with :mod:`.live` and takes packs apart
  with :mod:`.unpack`.
- :mod:`.verify`: checking everything a load would refuse, reported, never raised.
"""
