"""Writing: how a checkpoint enters a vault, whole or not at all.

:func:`.save.save` turns an adapter's tensors into objects and a record, then hands them to
the commit protocol of :mod:`.commit`: an intent names the objects first, the objects are
written (loose or in one pack), the record is written last by an atomic rename, and the
intent is released. A crash at any point leaves either the old vault or the new
checkpoint, never half of one; gc never frees an object an intent names.
"""
