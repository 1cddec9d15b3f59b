"""Loading by name: rename rules, transforms, the load plan every adapter follows (plan,
auto, mismatch), and the framework-free steps adapters share around it (steps, values,
resume)."""
