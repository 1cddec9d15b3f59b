"""weightvault.jax's private half: naming a model's arrays, and its frozen flags."""
