"""Configurations of the LM example (``ml_collections.ConfigDict``).

``default.py`` trains on this CPU in minutes (8 fake devices, mesh (2, 2, 2)); ``tiny.py`` is the
tests' config; ``pod.py`` is the ~1B-parameter model for a TPU slice (compiled ahead of time
by a slow test).
"""
