"""Travel: checkpoints moving between vaults, sending only what the receiver lacks.

:mod:`.transfer` is push and pull: select the checkpoints, plan which objects the receiver
lacks, re-encode and verify them, write them durably, then commit their records.
:mod:`.mirror` runs a transfer after each save, beside training.
"""
