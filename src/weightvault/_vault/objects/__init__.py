"""Objects: one tensor's bytes as the vault stores them, named by their content.

An object is the blake3 of a tensor's raw bytes, stored loose (``objects/ab/cdef...``) or
in a pack. Its bytes are either the raw tensor, or a frame: a compressed whole, or a delta
on another object of the same tensor.

Parts, in the order a read calls them:

- :mod:`.prefetch`: on a remote store, the files of a load's objects and of their bases,
  fetched ahead and concurrently.
- :mod:`.address`: an object's name (blake3) and key, and the order in which a read looks
  for it: ``objects/``, a pack, a gc's trash, ``objects/`` again.
- :mod:`.file`: the object's file, opened for reads by range (never mapped).
- :mod:`.chain`: the one walk down a delta's bases, every link opened and checked.
- :mod:`.frame`: the frame header that says what a non-raw object holds.
- :mod:`.transforms`: the two delta transforms, XOR and zigzag difference.
- :mod:`.codec` and :mod:`.blosc2_c`: byte planes then zstd, through blosc2.
- :mod:`.read`: the raw bytes, whole or a range, decoded through the chain; and the
  verified read, checked against the object's name.

Beside a read: :mod:`.probe` reads only a frame's header (what gc, the compactor and a
transfer ask of an object without reading it), and :mod:`.encoding` is what a writer
chooses for one object (raw, compressed, delta) and how deep a delta's chain is.
"""
