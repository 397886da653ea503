"""sglang-router takes one prompt per /generate: batches are split, each prompt keeping its own
sampling parameters (its seed) and rid."""

from tether.rollout.router_sglang import split_batch


def test_a_batch_splits_into_one_request_per_prompt():
    payload = {"input_ids": [[1, 2], [3]], "sampling_params": [{"sampling_seed": 1}, {"sampling_seed": 2}],
               "rid": ["a", "b"], "return_logprob": True}
    assert split_batch(payload) == [
        {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 1}, "rid": "a", "return_logprob": True},
        {"input_ids": [3], "sampling_params": {"sampling_seed": 2}, "rid": "b", "return_logprob": True}]
    shared = split_batch({"text": ["x", "y"], "sampling_params": {"temperature": 0.0}})
    assert [p["text"] for p in shared] == ["x", "y"] and all(p["sampling_params"] == {"temperature": 0.0} for p in shared)


def test_a_single_prompt_is_left_alone():
    assert split_batch({"input_ids": [1, 2, 3], "sampling_params": {}}) is None
    assert split_batch({"text": "hello"}) is None
