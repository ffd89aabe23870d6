"""Benchmarks: our helpers against raw driver round trips and peer libraries, in one run."""
