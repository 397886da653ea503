"""Moving weights from the trainer into the inference engines, behind one small interface (base.py)."""
