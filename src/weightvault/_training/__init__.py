"""Optimizer, scheduler and RNG state beside the weights, framework-free."""
