"""The GPU check's CPU mode (scripts/gpu_check.sh --cpu), as CI runs it, with Ray, vLLM and SGLang
unimportable (a bare GPU machine has none of them): every check passes and the table says so. And the
wheel folder for such a machine: prepared by one command, complete, and under 64 MiB with the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("ray", "vllm", "sglang")  # not on the GPU machine, and not to be needed there


def test_the_cpu_mode_of_the_gpu_check_passes_without_ray(tmp_path):
    stubs = tmp_path / "absent"
    for name in ABSENT:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stubs)}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads((out / "gpu_check.json").read_text())}
    assert list(rows) == ["environment", "model", "engine + logprobs, float32", "engine + logprobs, bfloat16",
                          "throughput (GRPO shape)", "train: GRPO step, FSDP2, bf16 mixed precision",
                          "push into the engine", "checkpoint + exact resume", "pytest tests/gpu"]
    assert all(r["status"] == "passed" for name, r in rows.items() if name != "pytest tests/gpu"), rows
    assert rows["pytest tests/gpu"]["status"] == "skipped" and " skipped" in rows["pytest tests/gpu"]["figures"]
    assert "vocabulary 151,936" in rows["model"]["figures"] and "replies changed" in rows["push into the engine"]["figures"]
    table = (out / "gpu_check.md").read_text()
    assert table.startswith("tether GPU check (CPU mode)") and table.count("| passed |") == 8
    assert "| check | result | figures | seconds |" in proc.stdout  # printed as well


def test_the_gpu_wheels_are_one_command_complete_and_small(tmp_path):
    out = tmp_path / "wheels"
    proc = subprocess.run(["bash", "scripts/gpu_wheels.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})
    offline = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution")
    if proc.returncode != 0 and any(why in proc.stderr for why in offline):
        pytest.skip(f"the package index cannot be reached: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = sorted(out.glob("*.whl"))
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    assert {"pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "pyyaml", "jinja2"} <= names
    assert all("cp312" in w.name or "py3-none-any" in w.name for w in wheels), [w.name for w in wheels]
    # Each wheel's requirements: another wheel here, or what such a machine has (Python 3.12 with these).
    machine = {"torch", "transformers", "safetensors", "numpy", "httpx", "pyarrow", "pytest", "triton"}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                        if line.startswith("Requires-Dist:")]
        for req in requires:
            if "extra ==" in req or "python_version < \"3.1" in req.replace("'", '"'):
                continue
            name = req.split(";")[0].split("[")[0].split("(")[0]
            for sep in "<>=!~ ":
                name = name.split(sep)[0]
            name = name.strip().lower().replace("_", "-")
            assert name in names | machine, f"{wheel.name} needs {name}, which is neither a wheel here nor on the machine"
    assert "with the checkout" in proc.stdout and "of 64" in proc.stdout
