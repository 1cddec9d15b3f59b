"""Integrations with training loops that checkpoint on their own.

Each lives in its own module and imports its framework; ``import weightvault`` imports
none of them:

- :mod:`weightvault.integrations.transformers`: ``VaultCallback`` for the Hugging Face
  ``Trainer``, and ``checkout`` to resume from the vault.
- :mod:`weightvault.integrations.lightning`: ``VaultCheckpointIO``, a Lightning
  ``CheckpointIO`` plugin.
- :mod:`weightvault.integrations.keras`: ``VaultCheckpoint``, a Keras callback shaped
  like ``ModelCheckpoint``, and ``restore`` to resume ``fit``.

See docs/integrations.md.
"""
