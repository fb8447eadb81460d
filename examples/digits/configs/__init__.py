"""Configurations of the digits example (``ml_collections.ConfigDict``)."""
