"""Rollout data: samples and the prompt data source."""

from tether.sample import Sample

__all__ = ["Sample"]
