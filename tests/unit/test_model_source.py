"""model.path as a Hugging Face Hub id: resolved from the local HF cache, a clear error when it cannot be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.cli import main
from tether.errors import ConfigError
from tether.models.source import is_hub_id, resolve_model
from tether.models.tiny import build_char_tokenizer, build_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_with_model(root: Path, repo: str, revision: str = "main") -> Path:
    """The Hub cache's layout (models--org--name/refs/<rev> -> snapshots/<commit>/...) holding a tiny model."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / COMMIT
    build_tiny_model(snapshot, build_char_tokenizer(), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=32, max_positions=64)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / revision).write_text(COMMIT)
    return snapshot


def _resolve_in_subprocess(spec: str, cache: Path, offline: bool = True) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when it is imported: a fresh interpreter
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = ("import sys; from tether.models.source import resolve_model\n"
            "try:\n    print(resolve_model(sys.argv[1]))\n"
            "except Exception as err:\n    print(err, file=sys.stderr); sys.exit(2)")
    return subprocess.run([sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=120)


def test_hub_id_from_the_cache_loads_as_a_model(tmp_path):
    cache = tmp_path / "hub"
    snapshot = _cache_with_model(cache, "tether-test/tiny-qwen2")
    done = _resolve_in_subprocess("tether-test/tiny-qwen2", cache)
    assert done.returncode == 0, done.stderr
    resolved = Path(done.stdout.strip())
    assert resolved == snapshot
    assert json.loads((resolved / "config.json").read_text())["model_type"] == "qwen2"

    from tether.models.hf import load_model, load_tokenizer

    model = load_model(str(resolved), "float32")
    assert model.config.vocab_size == len(load_tokenizer(str(resolved)))


def test_hub_id_at_a_revision(tmp_path):
    cache = tmp_path / "hub"
    snapshot = _cache_with_model(cache, "tether-test/tiny", revision="v1")
    done = _resolve_in_subprocess("tether-test/tiny@v1", cache)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot


def test_not_cached_and_offline_says_how_to_get_it(tmp_path):
    done = _resolve_in_subprocess("Qwen/Qwen2.5-0.5B-Instruct", tmp_path / "empty", offline=True)
    assert done.returncode == 2
    assert "model.path: Qwen/Qwen2.5-0.5B-Instruct is not a local directory and not in the Hugging Face cache" in done.stderr
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in done.stderr and "HF_HUB_OFFLINE" in done.stderr


def test_not_cached_with_no_network_says_the_download_failed(tmp_path):
    # this machine reaches no model hub: the download attempt fails at once, and the error says so
    done = _resolve_in_subprocess("Qwen/Qwen2.5-0.5B-Instruct", tmp_path / "empty", offline=False)
    assert done.returncode == 2
    assert "downloading it failed" in done.stderr and "hf download Qwen/Qwen2.5-0.5B-Instruct" in done.stderr


def test_local_paths_and_refusals(tmp_path):
    model = _cache_with_model(tmp_path / "hub", "a/b")
    assert resolve_model(str(model)) == str(model)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"model.path: .*m.gguf is a file.*tether import-gguf"):
        resolve_model(str(gguf))
    with pytest.raises(ConfigError, match="without an HF config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match=r"--model: ./nowhere does not exist at /\S+/nowhere, relative to the "
                                          r"working directory"):
        resolve_model("./nowhere", "--model")
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name@v1.0")
    assert not is_hub_id("runs/arithmetic/sft/hf")  # three parts: a path, never an id
    assert not is_hub_id("/abs/path") and not is_hub_id("./rel/x")


def test_cli_refuses_an_unresolvable_model_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    rc = main(["train", "model.path=nobody/no-such-model", f"data.path={data}", f"output_dir={tmp_path / 'run'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.path: nobody/no-such-model is not a local directory" in err and "hf download" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    from tether.config import config_from_dict
    from tether.run.preflight import check_inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    cfg = config_from_dict({"model": {"path": "model"}, "data": {"path": "data/train.jsonl"}})
    with pytest.raises(ConfigError, match=rf"data.path: data/train.jsonl does not exist \(looked for "
                                          rf"{tmp_path}/data/train.jsonl: data and model paths are relative to the "
                                          r"working directory, function specs to the config file's folder\)"):
        check_inputs(cfg, "train")
