"""Configurations of the ResNet example (``ml_collections.ConfigDict``).

``default.py`` is the ImageNet recipe with the source of every value; the
others start from it and change what their setting needs.
"""
