"""Fake devices are configured in the repository's root conftest.py (8 CPU devices)."""
