"""Objects: one tensor's bytes as the vault stores them, named by their content.

An object is the blake3 of a tensor's raw bytes, stored loose (``objects/ab/cdef...``) or
in a pack. Its bytes are either the raw tensor, or a frame: a compressed whole, or a delta
on another object of the same tensor.

Parts, in the order a read calls them:

- :mod:`.access`: hashing and locating an object, opening its file, reading it (raw or
  decoded, whole or a range) and checking it against its name.
- :mod:`.frame`: the frame header that says what a non-raw object holds.
- :mod:`.encoding`: the choice a writer makes for one object (raw, compressed, delta) and
  how deep a delta's chain is.
- :mod:`.transforms`: the two delta transforms, XOR and zigzag difference.
- :mod:`.codec` and :mod:`.blosc2_c`: byte planes then zstd, through blosc2.
"""
