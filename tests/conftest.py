"""Shared fixtures live in ``tests/harness.py`` (loaded as a plugin); this file stays small."""
