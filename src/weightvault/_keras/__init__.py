"""weightvault.keras' private half: Keras internals, the variable walk, the save half
(sources), Keras' own files (files), frozen flags (trainable) and training state."""
