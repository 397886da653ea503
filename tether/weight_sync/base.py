"""The interface every weight transport implements (object store, torch.distributed broadcast, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch


class WeightSender(ABC):
    """Trainer side of a transport: streams (name, full tensor) pairs to every engine."""

    @abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Deliver all tensors, then tell the engines the new weight version. Returns timing metrics."""
