"""The private half that weightvault.numpy and weightvault.jax share: arrays as sources."""
