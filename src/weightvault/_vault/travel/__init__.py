"""Travel: checkpoints moving between vaults, sending only what the receiver lacks.

In the order they are called:

1. :mod:`.moving` is ``Vault.push`` and ``Vault.pull``: it resolves the names, picks the
   receiver's codec, runs one transfer and carries the labels of what it sent.
2. :mod:`.transfer` runs a transfer: it registers the receiver's intent, then, checkpoint
   by checkpoint and in batches, sends the missing objects and commits each record.
3. :mod:`.select` chooses the checkpoints to send: those asked for, less those the
   receiver holds already.
4. :mod:`.plan` finds which objects the receiver lacks, following each delta's base
   (an anchor, or the links of an older vault's chain), and which of them go whole
   instead of bringing bases no checkpoint being sent needs.
5. :mod:`.send` reads each object's file from the source and checks it (decoded and
   hashed against its name), or re-encodes it whole.
6. :mod:`.deliver` writes the checked files on the receiver, durably, never replacing
   an object it holds.

:mod:`.mirror` runs a transfer after each save, beside training, off the training thread.
"""
