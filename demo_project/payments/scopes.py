"""Whose key space a payment's Idempotency-Key lives in: the calling shop's API key.

A payments API identifies its clients by an API key, not a browser session, so the demo scopes
keys by the (hashed) ``X-Api-Key`` header; a request without one is refused (400), never
pooled with other anonymous clients.
"""

from __future__ import annotations

from idempotency.scopes import by_header

by_api_key = by_header("X-Api-Key")
