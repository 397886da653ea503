"""`tether import-gguf` on the real SmolLM2-135M-Instruct GGUF file, and the files it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from tether.models.gguf import GGUFImportError, import_gguf, inspect_gguf, main, smollm2_gguf


def test_converted_folder_reproduces_the_gguf_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_gguf()
    out = import_gguf(source, tmp_path / "smollm2")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # an ordinary folder, not one tied to the GGUF file
    assert config["tie_word_embeddings"] is True

    tokenizer = AutoTokenizer.from_pretrained(out)
    gguf_tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    assert tokenizer.decode(ids).startswith("<|im_start|>system")  # the chat template came along
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == gguf_tokenizer.eos_token_id
    assert tokenizer.pad_token_id is not None

    with torch.no_grad():
        x = torch.tensor([ids])
        want = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                    dtype=torch.float32)(x).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(x).logits
    assert torch.equal(got, want)  # the same float32 weights, the same arithmetic


def _write_gguf(path, arch: str) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_refused_files_say_why(tmp_path, capsys):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        inspect_gguf(not_gguf)
    with pytest.raises(GGUFImportError, match="no such file"):
        inspect_gguf(tmp_path / "missing.gguf")

    bert = tmp_path / "bert.gguf"
    _write_gguf(bert, "bert")
    with pytest.raises(GGUFImportError, match=r"architecture 'bert' cannot be read.*llama"):
        inspect_gguf(bert)

    t5 = tmp_path / "t5.gguf"
    _write_gguf(t5, "t5")
    with pytest.raises(GGUFImportError, match="not a causal"):
        inspect_gguf(t5)

    # the command: exit status 2 and one line, nothing written
    assert main(str(t5), str(tmp_path / "out")) == 2
    assert "not a causal" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_non_empty_destination_is_kept(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="not empty"):
        import_gguf(smollm2_gguf(), out)
    assert (out / "keep.txt").read_text() == "mine"
