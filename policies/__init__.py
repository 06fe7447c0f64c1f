"""The built-in policies, shipped as package data (``clef_guard.policy.builtin``): load one by name."""
