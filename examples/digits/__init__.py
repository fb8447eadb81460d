"""Handwritten digits (scikit-learn ``load_digits``) trained with ``loopkit.TrainLoop``."""
