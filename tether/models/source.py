"""Where a model comes from: a local HF directory, or a Hugging Face Hub id resolved to one.

``model.path`` (and ``--model`` of eval and serve) is either a folder or a Hub id (``org/name``,
optionally ``org/name@revision``). An id is looked up in the local Hugging Face cache first (HF_HOME /
HF_HUB_CACHE, as every HF tool shares it) and downloaded only when it is not there and the network
is allowed (HF_HUB_OFFLINE unset). The driver resolves it once, before any process starts, and the
run carries on with the snapshot folder, so the actors, checkpoints and exports see a plain path.

No torch here: the CLI resolves models before it imports the training stack.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tether.errors import ConfigError

# org/name, as the Hub spells repository ids (letters, digits, '-', '_', '.'), with an optional @revision
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
# What a causal LM needs from a repository: weights, config, tokenizer, chat template. Not other
# formats' copies of the weights (.bin next to safetensors, GGUF, ONNX), which can be many GB.
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not spec.startswith((".", "/", "~"))


def resolve_model(spec: str, field: str = "model.path") -> str:
    """A local directory holding the model ``spec`` names; a ConfigError naming ``field`` otherwise."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{field}: {spec} is a directory without an HF config.json")
        return str(path)
    if path.is_file():
        hint = (f"; convert it first: tether import-gguf {spec} OUT_DIR" if path.suffix == ".gguf" else "")
        raise ConfigError(f"{field}: {spec} is a file, not an HF model directory{hint}")
    match = _HUB_ID.match(spec)
    if not match or spec.startswith((".", "/", "~")):
        where = "" if path.is_absolute() else f" at {path.resolve()}, relative to the working directory"
        raise ConfigError(f"{field}: {spec} does not exist{where} (neither a local directory nor a Hugging Face "
                          "Hub id like Qwen/Qwen2.5-0.5B-Instruct)")
    return _from_hub(match["repo"], match["rev"], spec, field)


def _from_hub(repo: str, revision: str | None, spec: str, field: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=_PATTERNS)
    except (LocalEntryNotFoundError, FileNotFoundError, HFValidationError):
        pass  # not cached: download below, when allowed
    download = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{field}: {spec} is not a local directory and not in the Hugging Face cache ({cache}), "
                          f"and HF_HUB_OFFLINE is set. Download it where the network allows: `{download}` "
                          "(then copy the cache here, or point HF_HOME at it)")
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=_PATTERNS, etag_timeout=10)
    except Exception as err:  # no network, a gated or missing repo: say which, and how to get it
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        raise ConfigError(f"{field}: {spec} is not a local directory and not in the Hugging Face cache ({cache}); "
                          f"downloading it failed ({reason}). Download it where the network allows: `{download}` "
                          "(then copy the cache here, or point HF_HOME at it)") from None
