"""The engine contract's payload checks, written once for every server that mounts the contract
(the embedded engine's server.py, the vLLM adapter): each turns a request body into what the engine
takes, or raises PayloadError with the message the client gets (HTTP 400)."""

from __future__ import annotations

import base64

import torch
from fastapi import HTTPException
from safetensors.torch import load as load_safetensors

from tether.engine.base import MEMORY_TAGS
from tether.engine.protocol import TagsIn, UpdateDistributedIn, UpdateWeightsIn
from tether.weight_sync.group import DTYPES


class PayloadError(ValueError):
    """A request body the contract refuses; the message names the field."""


def memory_tags(body: TagsIn) -> list[str]:
    """The tags of a /release_memory_occupation or /resume_memory_occupation (none given: all)."""
    tags = list(body.tags) if body.tags else list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise PayloadError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tags


def bucket_tensors(body: UpdateWeightsIn) -> dict[str, torch.Tensor]:
    """The named tensors of an /update_weights_from_tensor (base64 safetensors: no pickle on the wire)."""
    try:
        return load_safetensors(base64.b64decode(body.serialized_named_tensors))
    except Exception as err:  # a corrupt payload is the client's error, said in its words
        raise PayloadError(f"serialized_named_tensors is not base64 safetensors: {err}") from None


def check_distributed(body: UpdateDistributedIn) -> None:
    """An /update_weights_from_distributed names one dtype and shape per tensor, of known dtypes."""
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise PayloadError("names, dtypes and shapes must have the same length")
    unknown = [d for d in body.dtypes if d not in DTYPES]
    if unknown:
        raise PayloadError(f"unknown dtypes {unknown}; known: {list(DTYPES)}")


def checked(check, body):
    """``check(body)`` inside a route: its PayloadError becomes the client's 400, with its message."""
    try:
        return check(body)
    except PayloadError as err:
        raise HTTPException(status_code=400, detail=str(err)) from None
