"""weightvault.torch's private half: tensors as records (tensors), the save half
(sources), the load half (assign) and training state (state)."""
