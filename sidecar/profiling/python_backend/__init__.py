"""Replaying Triton Python-backend models by running their own `model.py` (see `loader`)."""
