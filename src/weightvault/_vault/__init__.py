"""The vault: checkpoints whose tensors are stored once, by content, in one store."""
