"""Writing: how a checkpoint enters a vault, whole or not at all.

In the order they are called:

1. :mod:`.deferred` runs a background save (``Vault.save(background=True)``) in a thread
   of its own, once the copies it needs are made; a save in the foreground skips it.
2. :mod:`.save` (:func:`~.save.save_sources`) turns an adapter's tensors into objects and
   a record, hashing and checksumming each object once.
3. :mod:`.commit` is the commit protocol every writer follows: an intent names the
   objects first, the objects are written (loose or in one pack) and made durable, the
   record is created last, exclusively, and the intent is released.

A crash at any point leaves either the old vault or the new checkpoint, never half of
one; gc never frees an object an intent names. The threads a save hashes and writes on
are :data:`weightvault._base.pools.workers`.
"""
