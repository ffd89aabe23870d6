"""Idempotency keys: run an effect once however often a client retries it."""
