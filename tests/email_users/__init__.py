"""A custom user model that logs in by e-mail address and has no ``username`` field, for the
child projects of tests/test_custom_user_model.py (never installed in tests/settings.py)."""
