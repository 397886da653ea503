"""Rollout data: samples and the prompt data source."""

from tether.rollout.sample import Sample

__all__ = ["Sample"]
