"""The contract's payload checks (tether/engine/payloads.py), as every server that mounts the contract
applies them: a bad body is refused naming what is wrong."""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import save

from tether.engine.payloads import PayloadError, bucket_tensors, check_distributed, memory_tags
from tether.engine.protocol import TagsIn, UpdateDistributedIn, UpdateWeightsIn


def test_memory_tags_default_to_all_and_refuse_unknown_ones():
    assert set(memory_tags(TagsIn())) == {"weights", "kv_cache"}
    assert memory_tags(TagsIn(tags=["kv_cache"])) == ["kv_cache"]
    with pytest.raises(PayloadError, match=r"unknown memory tags \['cuda_graph'\]"):
        memory_tags(TagsIn(tags=["cuda_graph"]))


def test_a_bucket_is_base64_safetensors_or_refused():
    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    body = UpdateWeightsIn(serialized_named_tensors=base64.b64encode(save(tensors)).decode(), weight_version=3)
    assert torch.equal(bucket_tensors(body)["w"], tensors["w"])
    with pytest.raises(PayloadError, match="serialized_named_tensors is not base64 safetensors"):
        bucket_tensors(UpdateWeightsIn(serialized_named_tensors=base64.b64encode(b"pickle?").decode()))


def test_a_distributed_bucket_names_a_known_dtype_and_a_shape_per_tensor():
    def body(**kw):
        return UpdateDistributedIn(**{"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2], [3, 4]],
                                      "group_name": "g", **kw})

    check_distributed(body())
    with pytest.raises(PayloadError, match="names, dtypes and shapes must have the same length"):
        check_distributed(body(shapes=[[2]]))
    with pytest.raises(PayloadError, match=r"unknown dtypes \['float8'\]"):
        check_distributed(body(dtypes=["float32", "float8"]))
