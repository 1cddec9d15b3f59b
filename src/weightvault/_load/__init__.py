"""Loading by name: rename rules, transforms, and the load plan every adapter follows."""
