"""weightvault.torch's private half: tensor helpers and training state."""
