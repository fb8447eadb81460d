"""loopkit examples (run from the repository root, e.g. ``python -m examples.digits.main``)."""
