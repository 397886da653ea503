"""A LoRA run end to end: `tether train` with model.lora and a KL term (the reference is the base with
the adapters off), pushes of the adapted layers only, a checkpoint holding adapters alone, a kill and
a resume ending on the same weights, and both exports (merged model, PEFT adapter folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.integration.test_resume_exact import ROOT, assert_same_weights, tether_train, trained, write_config
from tether.models.export import export_checkpoint
from tether.models.hf import load_model
from tether.run.checkpoint import find_latest
from tether.run.safe_load import SafeReader

pytestmark = pytest.mark.integration
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_config(tmp_path: Path, model_dir: Path, data: dict, name: str) -> Path:
    path = write_config(tmp_path, model_dir, data, name)
    raw = yaml.safe_load(path.read_text())
    raw["model"]["lora"] = LORA
    raw["train"]["lr"] = 1e-2
    raw["algorithm"] = {"kl_loss_coef": 0.1}
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, addition_data):
    tmp = tmp_path_factory.mktemp("lora")
    config = lora_config(tmp, tiny_model_dir, addition_data, "straight")
    tether_train(config)
    return tmp, config


def test_a_lora_run_trains_adapters_pushes_their_layers_and_keeps_them(lora_run, tiny_model_dir):
    tmp, _ = lora_run
    out = tmp / "straight"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 6 adapted layers of 2 x 32 x 32 (q), 2 x 16 x 32 (v: 2 KV heads of 8), 2 x 32 x 64 (down), float32
    adapted_mb = 4 * (2 * 32 * 32 + 2 * 16 * 32 + 2 * 32 * 64) / 2**20
    pushes = [r["weight_sync/megabytes"] for r in rows if "weight_sync/megabytes" in r]
    assert pushes and all(mb == pytest.approx(adapted_mb) for mb in pushes), pushes
    # the engines serve the trained policy: their log-probs are the trainer's (float32, same kernels)
    assert max(r["mismatch/logprob_abs_diff_max"] for r in rows if "mismatch/logprob_abs_diff_max" in r) < 1e-4
    # the policy moved away from the reference (the base), and the KL term saw it
    assert any(r.get("train/kl", 0) > 0 for r in rows), [k for k in rows[-1] if "kl" in k]
    base = load_model(str(tiny_model_dir), "float32").state_dict()
    final = load_file(str(out / "hf" / "model.safetensors"))
    moved = sorted({k.split(".")[3] + "." + k.split(".")[4] for k in final if not torch.equal(final[k], base[k])})
    assert moved == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]

    # the checkpoint holds the adapters and their optimizer state, never the frozen base
    checkpoint, _ = find_latest(out / "checkpoints")
    keys = list(SafeReader(str(checkpoint / "train")).read_metadata().state_dict_metadata)
    weights = [k for k in keys if k.startswith("train.model.")]
    assert weights and all(k.endswith((".lora_A", ".lora_B")) for k in weights), weights[:5]
    assert any(k.startswith("train.optim.state.") and "lora_A" in k and k.endswith("exp_avg") for k in keys)


def test_a_killed_lora_run_resumes_to_the_same_weights(lora_run, tiny_model_dir, addition_data):
    tmp, _ = lora_run
    config = lora_config(tmp, tiny_model_dir, addition_data, "chain")
    ckpts = tmp / "chain" / "checkpoints"
    assert tether_train(config, crash_at="train:3", load=ckpts) == -9
    tether_train(config, load=ckpts)
    assert trained(tmp / "chain") == trained(tmp / "straight")
    assert_same_weights(load_file(str(tmp / "chain" / "hf" / "model.safetensors")),
                        load_file(str(tmp / "straight" / "hf" / "model.safetensors")))


def test_exports_merged_and_as_a_peft_adapter(lora_run, tiny_model_dir, tmp_path):
    import peft

    tmp, _ = lora_run
    ckpts = tmp / "straight" / "checkpoints"
    merged = export_checkpoint(ckpts, tmp_path / "merged")
    assert_same_weights(load_file(str(merged / "model.safetensors")),
                        load_file(str(tmp / "straight" / "hf" / "model.safetensors")))
    cli = subprocess.run([sys.executable, "-m", "tether.cli", "export", str(ckpts), str(tmp_path / "adapter"), "--adapter"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(LORA["target_modules"])
    with_adapter = peft.PeftModel.from_pretrained(load_model(str(tiny_model_dir), "float32"), str(tmp_path / "adapter"))
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        want = load_model(str(merged), "float32")(input_ids=ids).logits
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_target_modules_matching_nothing_stop_the_run_before_it_starts(tiny_model_dir, addition_data, tmp_path):
    config = lora_config(tmp_path, tiny_model_dir, addition_data, "bad")
    proc = subprocess.run([sys.executable, "-m", "tether.cli", "train", "--config", str(config),
                           "model.lora.target_modules=[qkv]"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "model.lora.target_modules ['qkv'] matches no linear layer" in proc.stderr, proc.stderr[-2000:]
    assert "'q_proj'" in proc.stderr and not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_sft_with_lora_trains_the_adapters_and_exports_the_merged_model(tiny_model_dir, tmp_path):
    from tests.integration.test_sft_resume import _config, _sft

    config = _config(tmp_path, tiny_model_dir, "sft")
    raw = yaml.safe_load(config.read_text())
    raw["model"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["o_proj", "up_proj"]}
    raw["train"]["lr"] = 1e-2
    config.write_text(yaml.safe_dump(raw))
    out = _sft(config)
    assert "LoRA: 1,280 of" in out  # 2 layers x (o_proj 4 x (32 + 32) + up_proj 4 x (32 + 64))
    base = load_model(str(tiny_model_dir), "float32").state_dict()
    final = load_file(str(tmp_path / "sft" / "hf" / "model.safetensors"))
    moved = sorted({".".join(k.split(".")[3:5]) for k in final if not torch.equal(final[k], base[k])})
    assert moved == ["mlp.up_proj", "self_attn.o_proj"]
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0]
