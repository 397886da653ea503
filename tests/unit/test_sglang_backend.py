"""The SGLang backend without SGLang: its launch command, its request bodies checked against SGLang's
own request dataclasses, reply parsing, and the actor's weight and memory requests driven against
the embedded engine's server standing in for SGLang (with SGLang's weight routes added, as strict as
SGLang's fields). The real server is exercised in tests/gpu/test_sglang_gpu.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import httpx
import pytest
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import load_file

from tether.engine.config import SglangConfig
from tether.engine.sglang import (
    SglangEngineActor, check_reply, disk_update_body, launch_args, lora_body, memory_body, version_body,
    write_safetensors,
)
from tether.weight_sync.packed import pack_bucket
from tether.weight_sync.shared_memory import StagingSegment

# The request dataclasses of python/sglang/srt/managers/io_struct.py (sgl-project/sglang main, commit
# 001067ff): every field, and the ones without a default.
SGLANG_FIELDS = {
    "UpdateWeightFromDiskReqInput": (
        {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
         "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}, {"model_path"}),
    "UpdateWeightVersionReqInput": ({"new_version", "abort_all_requests"}, {"new_version"}),
    "ReleaseMemoryOccupationReqInput": ({"tags"}, set()),
    "ResumeMemoryOccupationReqInput": ({"tags"}, set()),
    "LoadLoRAAdapterReqInput": ({"lora_name", "lora_path", "pinned", "lora_id"}, {"lora_name", "lora_path"}),
    "UnloadLoRAAdapterReqInput": ({"lora_name", "lora_id"}, {"lora_name"}),
}
SGLANG_MEMORY_TAGS = {"weights", "kv_cache"}  # "Currently we only support `weights` and `kv_cache`"


def assert_sglang_shaped(body: dict, request: str) -> None:
    fields, required = SGLANG_FIELDS[request]
    assert set(body) <= fields, f"{request} has no field(s) {set(body) - fields}"
    assert required <= set(body), f"{request} needs {required - set(body)}"


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}


# ------------------------------------------------------------ pure functions
def test_launch_args_carry_the_config_and_extra_args_as_written():
    cfg = SglangConfig(mem_fraction_static=0.3, tp_size=2, extra_args=["--attention-backend", "triton",
                                                                       "--max-running-requests", "8"])
    args = launch_args("/models/m", 31000, cfg, "bfloat16", 7)
    assert args[:2] == ["-m", "sglang.launch_server"]
    assert args[-4:] == ["--attention-backend", "triton", "--max-running-requests", "8"]
    f = flags(args)
    assert f["--model-path"] == "/models/m" and f["--port"] == "31000" and f["--host"] == "127.0.0.1"
    assert f["--dtype"] == "bfloat16" and f["--random-seed"] == "7" and f["--weight-version"] == "0"
    assert f["--mem-fraction-static"] == "0.3" and f["--tp-size"] == "2"
    assert "--enable-memory-saver" in args
    off = launch_args("/m", 1, SglangConfig(enable_memory_saver=False), "float16", 0, host="0.0.0.0")
    assert "--enable-memory-saver" not in off and flags(off)["--host"] == "0.0.0.0"


def test_a_lora_policy_changes_the_launch():
    args = launch_args("/m", 1, SglangConfig(), "bfloat16", 0, lora=(16, ["down_proj", "q_proj"]))
    assert "--enable-lora" in args and flags(args)["--max-lora-rank"] == "16" and flags(args)["--max-loras-per-batch"] == "1"
    at = args.index("--lora-target-modules")
    assert args[at + 1:at + 3] == ["down_proj", "q_proj"] and "--enable-weights-cpu-backup" in args
    assert "--enable-lora" not in launch_args("/m", 1, SglangConfig(), "bfloat16", 0)


def test_request_bodies_have_sglang_field_names_and_types():
    disk = disk_update_body(Path("/dev/shm/stage"))
    assert_sglang_shaped(disk, "UpdateWeightFromDiskReqInput")
    assert disk["model_path"] == "/dev/shm/stage" and disk["abort_all_requests"] is False
    version = version_body(12)
    assert_sglang_shaped(version, "UpdateWeightVersionReqInput")
    assert version == {"new_version": "12", "abort_all_requests": False}  # a string; never abort the rollout
    for tags in (["weights"], ["kv_cache"], ["weights", "kv_cache"]):
        body = memory_body(tags)
        assert_sglang_shaped(body, "ReleaseMemoryOccupationReqInput")
        assert set(body["tags"]) <= SGLANG_MEMORY_TAGS
    with pytest.raises(ValueError, match="unknown memory tags"):
        memory_body(["gpu"])
    assert_sglang_shaped(lora_body(Path("/dev/shm/a")), "LoadLoRAAdapterReqInput")
    assert_sglang_shaped({"lora_name": "tether-policy"}, "UnloadLoRAAdapterReqInput")


def test_replies_are_parsed_and_errors_name_the_route():
    assert check_reply(httpx.Response(200, json={"success": True, "message": "ok"}), "POST /x") == \
        {"success": True, "message": "ok"}
    assert check_reply(httpx.Response(200), "POST /release_memory_occupation") == {}
    assert check_reply(httpx.Response(200, text="Cache flushed."), "POST /flush_cache") == {"text": "Cache flushed."}
    with pytest.raises(RuntimeError, match=r"POST /update_weights_from_disk answered 400: .*no such tensor"):
        check_reply(httpx.Response(400, json={"success": False, "message": "no such tensor"}),
                    "POST /update_weights_from_disk")
    with pytest.raises(RuntimeError, match=r"POST /update_weight_version answered 200"):
        check_reply(httpx.Response(200, json={"success": False, "message": "busy"}), "POST /update_weight_version")
    with pytest.raises(RuntimeError, match=r"GET /health answered 503"):
        check_reply(httpx.Response(503, text="not ready"), "GET /health")


def test_safetensors_written_from_views_of_one_buffer(tmp_path):
    buffer = torch.arange(64, dtype=torch.float32)
    tensors = {"a": buffer[:16].view(4, 4), "b": buffer[16:48].to(torch.bfloat16).view(2, 16),
               "c": buffer[48:52].to(torch.float16), "empty": torch.empty(0, 3), "ids": torch.arange(5)}
    path = tmp_path / "x.safetensors"
    assert write_safetensors(path, tensors) == sum(t.numel() * t.element_size() for t in tensors.values())
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


# ------------------------------------------------------------ the embedded engine standing in for SGLang
def strict_model(request: str, types: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model of one SGLang request: its fields only (extra ones are refused)."""
    fields, required = SGLANG_FIELDS[request]
    annotations = {f: types.get(f, Any) if f in required else Optional[types.get(f, Any)] for f in fields}
    defaults = {f: None for f in fields - required}
    return type(request, (BaseModel,), {"__annotations__": annotations, **defaults,
                                        "model_config": ConfigDict(extra="forbid", strict=True)})


@pytest.fixture(scope="module")
def stand_in(tiny_model_dir):
    """The embedded engine's server plus SGLang's /update_weights_from_disk and /update_weight_version
    (versions as strings, as SGLang has them); records the bodies it got."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine, EngineError
    from tether.engine.server import build_app
    from tether.models.hf import load_tokenizer
    from tether.http.server import ThreadedServer

    engine = EmbeddedEngine(str(tiny_model_dir))
    core = EngineCore(engine, load_tokenizer(str(tiny_model_dir)))
    app = build_app(core)
    seen: list[tuple[str, dict]] = []
    def validated(model: type[BaseModel], raw: dict) -> Any:
        try:
            return model.model_validate(raw)
        except ValidationError as err:  # a field SGLang does not have, or a wrong type
            raise HTTPException(status_code=422, detail=str(err)) from None

    DiskIn = strict_model("UpdateWeightFromDiskReqInput", {"model_path": str, "weight_version": str})
    VersionIn = strict_model("UpdateWeightVersionReqInput", {"new_version": str})

    @app.post("/update_weights_from_disk")
    def update_from_disk(raw: dict) -> Any:
        body = validated(DiskIn, raw)
        seen.append(("/update_weights_from_disk", raw))
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(body.model_path).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        try:
            core.exclusive(lambda: engine.load_weight_bucket(tensors, engine.weight_version))
        except EngineError as err:
            return JSONResponse({"success": False, "message": str(err), "num_paused_requests": 0}, status_code=400)
        return {"success": True, "message": f"loaded {len(tensors)}", "num_paused_requests": 0}

    @app.post("/update_weight_version")
    def update_version(raw: dict) -> dict:
        body = validated(VersionIn, raw)
        seen.append(("/update_weight_version", raw))
        core.exclusive(lambda: engine.commit_weights(int(body.new_version)))
        return {"success": True, "message": "ok", "new_version": body.new_version}

    LoadIn = strict_model("LoadLoRAAdapterReqInput", {"lora_name": str, "lora_path": str})
    UnloadIn = strict_model("UnloadLoRAAdapterReqInput", {"lora_name": str})
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    loaded: dict[str, list[str]] = {}  # adapter name -> the weights it changed

    @app.post("/load_lora_adapter")
    def load_lora(raw: dict) -> Any:
        """As SGLang: a name loads once; the PEFT folder is read when it loads. The stand-in serves the
        adapter by merging it into the base (W + lora_alpha / r * B A), the model every request then sees."""
        import json

        body = validated(LoadIn, raw)
        seen.append(("/load_lora_adapter", raw))
        if body.lora_name in loaded:
            return JSONResponse({"success": False, "message": f"{body.lora_name} is already loaded"}, status_code=400)
        config = json.loads((Path(body.lora_path) / "adapter_config.json").read_text())
        tensors = load_file(str(Path(body.lora_path) / "adapter_model.safetensors"))
        merged = {}
        for name in {n.removeprefix("base_model.model.").rpartition(".lora_")[0] for n in tensors}:
            a = tensors[f"base_model.model.{name}.lora_A.weight"].float()
            b = tensors[f"base_model.model.{name}.lora_B.weight"].float()
            merged[f"{name}.weight"] = base[f"{name}.weight"] + config["lora_alpha"] / config["r"] * (b @ a)
        core.exclusive(lambda: (engine.load_weight_bucket(merged, engine.weight_version),
                                engine.commit_weights(engine.weight_version)))
        loaded[body.lora_name] = list(merged)
        return {"success": True, "error_message": "", "loaded_adapters": {body.lora_name: body.lora_path}}

    @app.post("/unload_lora_adapter")
    def unload_lora(raw: dict) -> Any:
        body = validated(UnloadIn, raw)
        seen.append(("/unload_lora_adapter", raw))
        if body.lora_name not in loaded:
            return JSONResponse({"success": False, "message": f"{body.lora_name} is not loaded"}, status_code=400)
        restored = {name: base[name] for name in loaded.pop(body.lora_name)}
        core.exclusive(lambda: (engine.load_weight_bucket(restored, engine.weight_version),
                                engine.commit_weights(engine.weight_version)))
        return {"success": True, "error_message": "", "loaded_adapters": {}}

    server = ThreadedServer(app, "127.0.0.1", 0, "SGLang stand-in").start()
    yield server.url, engine, seen
    server.stop()
    core.shutdown()


@pytest.fixture()
def actor(stand_in):
    actor = SglangEngineActor.attach(stand_in[0])
    yield actor
    stage = actor._stage
    actor.shutdown()
    assert not stage.exists()


def greedy(url: str, prompt: list[int]) -> list[int]:
    reply = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


def test_health_of_an_attached_server(actor, stand_in):
    h = actor.health()
    assert h["url"] == actor.url() == stand_in[0] and h["backend"] == "sglang" and h["server_pid"] is None
    assert h["weight_version"] == 0 and h["released"] == []


def test_buckets_from_shared_memory_and_the_object_store_change_replies_then_commit(actor, stand_in):
    url, engine, seen = stand_in
    seen.clear()
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = greedy(url, [5, 6, 7])
    start = engine.weight_version
    norm, layer = "model.norm.weight", "model.layers.0.mlp.up_proj.weight"
    segment = StagingSegment(1 << 16)
    try:
        shared = segment.write(0, [(norm, -original[norm])])  # the trainer's segment on this host
        assert actor.load_weight_bucket(shared, start + 1, overlapped=True) == 1
        assert actor.load_weight_bucket(pack_bucket([(layer, original[layer] * 2)]), start + 1) == 1
    finally:
        segment.close()
    assert not list(actor._stage.iterdir())  # each bucket's file went once it was loaded
    assert torch.equal(engine.model.state_dict()[norm], -original[norm])
    assert actor.commit_weights(start + 1) == start + 1
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == start + 1
    assert actor.health()["weight_version"] == start + 1
    assert greedy(url, [5, 6, 7]) != before
    actor.load_weight_bucket(pack_bucket([(norm, original[norm]), (layer, original[layer])]), start + 2)
    actor.commit_weights(start + 2)
    assert greedy(url, [5, 6, 7]) == before
    routes = [route for route, _ in seen]
    assert routes == ["/update_weights_from_disk"] * 2 + ["/update_weight_version"] + \
        ["/update_weights_from_disk", "/update_weight_version"]
    assert seen[2][1] == {"new_version": str(start + 1), "abort_all_requests": False}


def test_memory_release_and_resume_then_a_full_push(actor, stand_in, tiny_model_dir):
    url, engine, _ = stand_in
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    before = greedy(url, [5, 6])
    actor.release_memory(["kv_cache"])
    assert engine.released == {"kv_cache"} and actor.health()["released"] == ["kv_cache"]
    actor.resume_memory(["kv_cache"])
    actor.release_memory(["weights", "kv_cache"])
    assert engine.released == {"weights", "kv_cache"}
    actor.resume_memory(["weights", "kv_cache"])
    assert engine.released == set() and engine.pending_weights > 0  # released weights wait for a push
    version = engine.weight_version + 1
    actor.load_weight_bucket(pack_bucket(list(state.items())), version)
    actor.commit_weights(version)
    assert engine.pending_weights == 0 and actor.health()["released"] == []
    assert greedy(url, [5, 6]) == before


def test_the_stand_in_is_as_strict_as_sglang_fields(stand_in):
    url = stand_in[0]
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": 3}).status_code == 422  # not a str
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/x", "names": []}).status_code == 422


def test_a_lora_policy_is_served_as_an_adapter_loaded_by_name(stand_in, tiny_model_dir):
    """engine.lora_updates: adapter: the actor loads adapters that change nothing as tether-policy, then
    each push's adapters (PEFT's names, kept aside from the weight route) as a new folder, unloading the
    last; what the server then serves is the trainer's merged model."""
    from tether.models.hf import load_model
    from tether.models.lora import adapter_state, apply_lora, lora_layers, merged_tensors
    from tether.models.lora_config import LoRAConfig

    url, engine, seen = stand_in
    seen.clear()
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    actor = SglangEngineActor.attach(url, model_path=str(tiny_model_dir), dtype="float32", lora=lora)
    try:
        actor.health()
        assert [route for route, _ in seen] == ["/load_lora_adapter"]
        assert seen[0][1]["lora_name"] == "tether-policy"
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # zero adapters
        torch.manual_seed(0)
        model = load_model(str(tiny_model_dir), "float32")
        apply_lora(model, LoRAConfig(**lora))
        for step in (1, 2):
            with torch.no_grad():
                for layer in lora_layers(model).values():
                    layer.lora_B.normal_(0, 0.5)
            adapters = list(adapter_state(model).items())
            version = engine.weight_version + 1
            assert actor.load_weight_bucket(pack_bucket(adapters[:3]), version) == 3  # kept for the commit
            assert actor.load_weight_bucket(pack_bucket(adapters[3:]), version) == len(adapters) - 3
            assert actor.commit_weights(version) == version
            served = engine.model.state_dict()
            for name, tensor in merged_tensors(model, only_adapted=True):
                torch.testing.assert_close(served[name], tensor, atol=1e-5, rtol=1e-5)
                assert not torch.allclose(tensor, before[name], atol=1e-3)  # the check can tell
            assert [p.name for p in actor._stage.iterdir()] == [f"adapter-push{step}"]  # the last one only
        routes = [route for route, _ in seen]
        assert routes == ["/load_lora_adapter"] + ["/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version"] * 2
    finally:
        httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "tether-policy"})  # the base again
        actor.shutdown()
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def test_a_refused_bucket_raises_naming_the_route_and_leaves_no_file(actor):
    with pytest.raises(RuntimeError, match=r"POST /update_weights_from_disk answered 400: .*unknown tensor"):
        actor.load_weight_bucket(pack_bucket([("no.such.weight", torch.zeros(2))]), 99)
    assert not list(actor._stage.iterdir())
    with pytest.raises(ValueError, match="unknown memory tags"):
        actor.release_memory(["gpu"])
