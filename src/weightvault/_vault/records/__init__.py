"""Records: what a checkpoint is, ``checkpoints/<name>.json``, and the views that read it.

A record names each tensor's object, dtype and shape, and carries the training state, the
user's metadata, labels and ties. It is sealed (:mod:`..store.seal`), so a load trusts no
byte of it before its sum checks.

Parts, in the order a load calls them:

- :mod:`.names`: the one check of a checkpoint's name, and the key its record has.
- :mod:`.order`: which record is the newest (``"latest"``), from the first bytes of each.
- :mod:`.reading`: reading a record against its seal; rewriting and deleting records.
- :mod:`.record`: the record's format: its fields, each checked, and the objects it
  names (:func:`~.record.object_digests`).
- :mod:`.checkpoint`: a committed checkpoint read through the same interface as a single
  file, so the one loader of ``weightvault._load`` serves both.
- :mod:`.dcp` and :mod:`.dcp_layout`: records of checkpoints written through
  ``torch.distributed.checkpoint``, whose tensors are lists of chunks.
- :mod:`.marks`: labels such as ``"best"``.
- :mod:`.intents`: what an in-flight save, transfer or compaction will reference.
- :mod:`.todo`: which checkpoints a save left to the compactor.
- :mod:`.usage`: what each checkpoint costs on disk.
- :mod:`.methods`: the listing and labelling methods of :class:`~weightvault.Vault`.
"""
