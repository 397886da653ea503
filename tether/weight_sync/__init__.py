"""Moving weights from the trainer into the inference engines, behind one small interface."""

from tether.weight_sync.base import WeightSender
from tether.weight_sync.object_store import ObjectStoreSender

__all__ = ["WeightSender", "ObjectStoreSender"]
