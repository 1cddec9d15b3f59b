"""weightvault.keras' private half: Keras internals, the variable walk, training state."""
