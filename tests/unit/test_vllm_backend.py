"""The vLLM backend's translation (SGLang-shaped contract <-> vLLM's endpoints), its command line, the
server-process lifecycle, and the config refusals; no vLLM needed (the contract suite runs it)."""

from __future__ import annotations

import sys

import pytest

from tether.config import ConfigError, config_from_dict
from tether.engine.config import VllmConfig
from tether.engine.protocol import SamplingParamsIn
from tether.engine.server_process import ServerProcess
from tether.engine.vllm import WORKER_EXTENSION, vllm_command
from tether.engine.vllm_adapter import sglang_reply, version_spans, vllm_sampling
from tether.errors import EngineStartError


def test_sampling_parameters_map_to_vllms_names():
    sp = SamplingParamsIn(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, stop_token_ids=[3], stop="\n",
                          sampling_seed=11, ignore_eos=True)
    out = vllm_sampling(sp, logprobs=True)
    assert out == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "ignore_eos": True,
                   "skip_special_tokens": True, "stop_token_ids": [3], "stop": ["\n"], "seed": 11, "logprobs": 0}
    assert "logprobs" not in vllm_sampling(SamplingParamsIn(), logprobs=False)


def test_version_spans_merge_and_map_the_initial_label():
    spans = [{"version": "default", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 5},
             {"version": "4", "start": 5, "end": 9}]
    assert version_spans(spans, version=3) == [[3, 3], [4, 6]]
    assert version_spans(None, version=2) == []


def test_a_vllm_choice_becomes_an_sglang_reply():
    choice = {"finish_reason": "length", "token_ids": [7, 8], "weight_versions": [{"version": "1", "start": 0, "end": 2}],
              "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -1.5}]}}
    out = sglang_reply(choice, "r1", 4, "ab", True, version=1)
    assert out["output_ids"] == [7, 8] and out["text"] == "ab"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 2} and meta["id"] == "r1"
    assert meta["output_token_logprobs"] == [[-0.5, 7, None], [-1.5, 8, None]]
    assert meta["weight_version"] == 1 and "weight_version_spans" not in meta
    both = sglang_reply({**choice, "weight_versions": [{"version": "1", "start": 0, "end": 1},
                                                       {"version": "2", "start": 1, "end": 2}]}, "r", 1, "", False, 2)
    assert both["meta_info"]["weight_version_spans"] == [[1, 1], [2, 1]] and both["meta_info"]["weight_version"] == 1
    assert sglang_reply({"finish_reason": "abort", "token_ids": []}, "r", 1, "", False, 0)["meta_info"][
        "finish_reason"]["type"] == "abort"
    assert sglang_reply({"finish_reason": "stop", "stop_reason": 5, "token_ids": [5]}, "r", 1, "", False, 0)[
        "meta_info"]["finish_reason"] == {"type": "stop", "matched": 5}


def test_the_vllm_command_line():
    cfg = VllmConfig(extra_args=["--max-num-seqs", "64"], env={"X": "1"}, max_model_len=512)
    args, env = vllm_command("/m", 1234, cfg, "float32", 3, "cpu")
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"] and args[-2:] == ["--max-num-seqs", "64"]
    assert args[args.index("--port") + 1] == "1234" and args[args.index("--max-model-len") + 1] == "512"
    assert args[args.index("--worker-extension-cls") + 1] == WORKER_EXTENSION and "--enforce-eager" in args
    assert "--enable-scale-out" in args and args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["X"] == "1" and "VLLM_CPU_KVCACHE_SPACE" in env
    gpu_args, gpu_env = vllm_command("/m", 1, VllmConfig(), "bfloat16", 0, "cuda")
    assert "--enable-sleep-mode" in gpu_args and "VLLM_CPU_KVCACHE_SPACE" not in gpu_env
    assert "--max-model-len" not in gpu_args  # the model's own limit


def test_a_lora_policy_is_served_as_a_runtime_lora():
    from tether.engine.vllm import lora_args

    args, env = vllm_command("/m", 1, VllmConfig(), "float32", 0, "cpu", lora_rank=12)
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "16"  # vLLM's next slot
    assert args[args.index("--max-loras") + 1] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain, plain_env = vllm_command("/m", 1, VllmConfig(), "float32", 0, "cpu")
    assert "--enable-lora" not in plain and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_env
    assert lora_args(1)[2] == "1" and lora_args(512)[2] == "512"
    with pytest.raises(ValueError, match="up to 512"):
        lora_args(513)


RANK_8 = {"rank": 8}


def test_what_a_lora_run_pushes_to_each_backend():
    from tether.engine.backends import ADAPTER, BACKENDS, LAYERS, WHOLE, engine_spec, lora_push

    def cfg(engine: dict, lora: dict | None = RANK_8):
        return config_from_dict({"model": {"path": "/m", "lora": lora}, "engine": engine})

    assert lora_push(cfg({"backend": "embedded"})) == LAYERS
    assert lora_push(cfg({"backend": "vllm"})) == ADAPTER
    assert lora_push(cfg({"backend": "vllm", "lora_updates": "merged"})) == WHOLE
    sglang = {"backend": "sglang"}
    gpu = {"cluster": {"gpus_per_bundle": 1}}
    assert lora_push(config_from_dict({"model": {"path": "/m", "lora": RANK_8}, "engine": sglang, **gpu})) == ADAPTER
    merged = {**sglang, "lora_updates": "merged"}
    assert lora_push(config_from_dict({"model": {"path": "/m", "lora": RANK_8}, "engine": merged, **gpu})) == LAYERS
    assert BACKENDS["sglang"].adapter_field == "lora_path" and BACKENDS["vllm"].adapter_field is None
    # vLLM's actor learns of the adapters only when it serves them
    assert engine_spec(cfg({"backend": "vllm"}), "cpu", 1)[1]["lora"]["rank"] == 8
    assert engine_spec(cfg({"backend": "vllm", "lora_updates": "merged"}), "cpu", 1)[1]["lora"] is None
    assert engine_spec(cfg({"backend": "vllm"}, None), "cpu", 1)[1]["lora"] is None
    with pytest.raises(ConfigError, match="model.lora.rank=600: vLLM serves LoRA ranks up to 512"):
        cfg({"backend": "vllm"}, {"rank": 600})
    cfg({"backend": "vllm", "lora_updates": "merged"}, {"rank": 600})  # merged pushes take any rank


def test_every_backends_actor_takes_the_arguments_it_is_given():
    """engine_spec's keyword arguments bind to each actor's constructor (SGLang's once lacked two)."""
    import inspect

    from tether.engine.backends import engine_spec

    for engine, extra in (({"backend": "embedded"}, {}), ({"backend": "vllm"}, {}),
                          ({"backend": "sglang"}, {"cluster": {"gpus_per_bundle": 1}})):
        for lora in (None, RANK_8):
            cfg = config_from_dict({"model": {"path": "/m", "lora": lora}, "engine": engine, **extra})
            actor, kwargs = engine_spec(cfg, "cpu", 1)
            inspect.signature(actor).bind(**kwargs)


def test_requests_name_the_adapter_where_the_engine_needs_them_to():
    """SGLang serves the policy's adapters only to requests carrying lora_path: the rollout's batches and
    a generate function's calls carry it; vLLM's adapter names it itself; full runs carry nothing."""
    from tether.engine.backends import request_fields
    from tether.engine.sampling import SamplingParams
    from tether.rollout.fleet import EngineFleet
    from tether.rollout.generate_fn import GenerateContext
    from tether.sample import Sample

    gpu = {"cluster": {"gpus_per_bundle": 1}}
    sglang = config_from_dict({"model": {"path": "/m", "lora": RANK_8}, "engine": {"backend": "sglang"}, **gpu})
    assert request_fields(sglang) == {"lora_path": "tether-policy"}
    merged = config_from_dict({"model": {"path": "/m", "lora": RANK_8},
                               "engine": {"backend": "sglang", "lora_updates": "merged"}, **gpu})
    full = config_from_dict({"model": {"path": "/m"}, "engine": {"backend": "sglang"}, **gpu})
    vllm = config_from_dict({"model": {"path": "/m", "lora": RANK_8}, "engine": {"backend": "vllm"}})
    assert request_fields(merged) == request_fields(full) == request_fields(vllm) == {}
    fleet = EngineFleet(["http://127.0.0.1:1"], 5.0, fields=request_fields(sglang))
    sample = Sample(prompt_index=0, sample_index=0, prompt="p", label=None, metadata={}, prompt_ids=[1, 2])
    payload = fleet.payload([sample], SamplingParams(max_new_tokens=4), [0], ["r0"])
    assert payload["lora_path"] == "tether-policy" and payload["input_ids"] == [[1, 2]]
    ctx = GenerateContext(url="http://x", client=None, tokenizer=None, cfg=sglang, rollout_id=0, evaluation=False,
                          rid="r", seed=0, is_cut=lambda: False, timeout_s=1.0)
    assert ctx._fields == {"lora_path": "tether-policy"}
    with pytest.raises(ConfigError, match="cannot arrive over cluster.weight_sync: distributed"):
        config_from_dict({"model": {"path": "/m", "lora": RANK_8}, "engine": {"backend": "sglang"},
                          "cluster": {"gpus_per_bundle": 1, "weight_sync": "distributed"}})


def test_a_server_that_exits_is_reported_with_its_command_and_log(tmp_path):
    proc = ServerProcess("test server", ["-c", "print('loading'); raise SystemExit('bad flag --x')"], None, {},
                         tmp_path / "s.log", "http://127.0.0.1:9/health")
    with pytest.raises(EngineStartError) as info:
        proc.wait_healthy(30)
    text = str(info.value)
    assert "test server exited with code 1" in text and "bad flag --x" in text and sys.executable in text
    proc.stop()


def test_a_server_that_never_answers_times_out_naming_the_url(tmp_path):
    proc = ServerProcess("slow server", ["-c", "import time; time.sleep(60)"], None, {}, tmp_path / "s.log",
                         "http://127.0.0.1:9/health")
    with pytest.raises(EngineStartError, match=r"did not answer http://127.0.0.1:9/health within 1s"):
        proc.wait_healthy(1)
    proc.stop()
    assert not proc.alive()


def _raw(**engine) -> dict:
    return {"model": {"path": "m"}, "engine": engine}


def test_engine_choices_are_checked_at_load():
    assert config_from_dict(_raw(backend="vllm")).engine.backend == "vllm"
    with pytest.raises(ConfigError, match="engine"):
        config_from_dict(_raw(backend="tgi"))
    with pytest.raises(ConfigError, match="sglang runs on GPUs"):
        config_from_dict(_raw(backend="sglang"))
    with pytest.raises(ConfigError, match="engine.vllm.startup_timeout_s"):
        config_from_dict(_raw(backend="vllm", startup_timeout_s=0))
    with pytest.raises(ConfigError, match="engine.vllm.pythn"):
        config_from_dict(_raw(backend="vllm", pythn="x"))
    assert config_from_dict({**_raw(), "cluster": {"router": "sglang_router"}}).cluster.router == "sglang_router"
