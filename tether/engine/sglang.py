"""The SGLang backend (engine.backend: sglang): an engine actor that runs ``python -m sglang.launch_server``
on its bundle and loads the trainer's weights into it.

SGLang speaks the engine contract natively (base.HTTP_CONTRACT is its API), so there is no adapter:
``url()`` is the server's own, and the router, the rollout and the distributed weight transport
(/init_weights_update_group, /update_weights_from_distributed) talk to SGLang directly. What this
actor adds is the object-store transport (``load_weight_bucket`` / ``commit_weights``), memory by tag
and the server's lifetime.

What SGLang offers for weights (read in sgl-project/sglang: python/sglang/srt/managers/io_struct.py at
main commit 001067ff, entrypoints/http_server.py, model_executor/model_runner.py, managers/tp_worker.py
and utils/common.py of recent versions; not run against a server here, see tests/gpu):

* POST /update_weights_from_tensor {serialized_named_tensors: [one str per TP rank], load_format,
  flush_cache, abort_all_requests, weight_version}. Each string is MultiprocessingSerializer output:
  base64 of a ForkingPickler pickle (CUDA tensors as IPC handles; recent versions unpickle it with a
  module allow-list). The scheduler unpickles the entry of its TP rank *before* it looks at
  load_format, so "direct", "flattened_bucket" (a pickled {flattened_tensor, metadata}) and a
  --custom-weight-loader dotted path all take a pickle too: no tensor route is pickle-free.
* POST /update_weights_from_disk {model_path, load_format, abort_all_requests, weight_version,
  flush_cache, ...}: the model's own load_weights over the *.safetensors files of a directory (HF
  names; each TP rank takes its shard). A directory holding some of the tensors updates those only.
* POST /update_weight_version {new_version, abort_all_requests (default true!)}; --weight-version at
  launch; versions are strings (tether sends str(int), the rollout reads int(...)).
* POST /release_memory_occupation, /resume_memory_occupation {tags}: "weights" and "kv_cache" (newer
  versions also know "cuda_graph"); they need --enable-memory-saver and no running request.

So each bucket is written as a safetensors file into a directory in /dev/shm (memory, not disk) and
loaded with /update_weights_from_disk; the file goes as soon as SGLang has read it, so one bucket at a
time sits there and no pickle goes on the wire. ``commit_weights`` then labels the version. Side
effect: SGLang records that directory as its model path (/get_model_info's model_path and the served
model name change after the first push; tether reads neither).

The distributed transport is SGLang's own API: the trainer builds the group as SGLang does (a TCP
rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``; weight_sync/group.py)
and sends weight_version as a string. That has been run here with tether's own engines standing in,
not against a real SGLang server (tests/gpu).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from tether.engine.backends import LORA_NAME
from tether.engine.base import WEIGHTS, EngineBackend, check_tags, node_address
from tether.engine.config import SglangConfig
from tether.engine.server_process import ServerProcess
from tether.http.client import engine_headers, sync_client
from tether.http.guard import DEFAULT_LIMITS, ServerLimits
from tether.http.server import free_port
from tether.models.hf import DTYPES
from tether.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_shapes, save_zero_adapter
from tether.models.lora_config import LoRAConfig
from tether.weight_sync.packed import PackedBucket, unpack_bucket
from tether.weight_sync.shared_memory import SegmentReader, SharedBucket, shared_memory_room

BUCKET_FILE = "tether-bucket.safetensors"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


# ------------------------------------------------------------ requests and replies (pure)
def launch_args(model_path: str, port: int, cfg: SglangConfig, dtype: str, seed: int,
                host: str = "127.0.0.1", api_key: str | None = None,
                lora: tuple[int, list[str]] | None = None) -> list[str]:
    """Arguments after the Python executable; cfg.extra_args go last, as written. ``lora``: (rank,
    target modules) of the adapters the policy is served as, loaded at run time."""
    args = ["-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--dtype", dtype, "--random-seed", str(seed), "--mem-fraction-static", str(cfg.mem_fraction_static),
            "--tp-size", str(cfg.tp_size), "--weight-version", "0"]
    if cfg.enable_memory_saver:
        args.append("--enable-memory-saver")
    if lora is not None:
        rank, modules = lora
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras-per-batch", "1",
                 "--lora-target-modules", *modules]
        if cfg.enable_memory_saver:  # released weights come back from host memory: no push brings the base
            args.append("--enable-weights-cpu-backup")
    if api_key:  # SGLang then asks every route but its health checks for the bearer token tether's clients send
        args += ["--api-key", api_key]
    return args + list(cfg.extra_args)


def disk_update_body(directory: str | Path) -> dict[str, Any]:
    """UpdateWeightFromDiskReqInput for one staged bucket (the version is labelled at commit)."""
    return {"model_path": str(directory), "abort_all_requests": False, "flush_cache": True}


def version_body(version: int) -> dict[str, Any]:
    """UpdateWeightVersionReqInput; SGLang's abort_all_requests defaults to true, so it is said."""
    return {"new_version": str(version), "abort_all_requests": False}


def memory_body(tags: list[str]) -> dict[str, Any]:
    """Release/ResumeMemoryOccupationReqInput: SGLang's tags are ours (weights, kv_cache)."""
    return {"tags": check_tags(tags)}


def lora_body(folder: Path) -> dict[str, Any]:
    """LoadLoRAAdapterReqInput: the policy's adapters, under the name every request gives (lora_path)."""
    return {"lora_name": LORA_NAME, "lora_path": str(folder)}


def check_reply(reply: httpx.Response, what: str) -> dict:
    """The reply's JSON object ({} when it has none); raises naming the route and the status when the
    status is not 200 or the body says success: false."""
    try:
        body = reply.json() if reply.content else {}
    except ValueError:  # SGLang answers some routes with plain text
        body = {"text": reply.text}
    if reply.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
        raise RuntimeError(f"SGLang {what} answered {reply.status_code}: {reply.text[:2000]}")
    return body if isinstance(body, dict) else {"reply": body}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """A safetensors file of the tensors, written straight from their memory (views of one shared
    segment are fine, unlike safetensors.torch.save_file); returns the bytes of tensor data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return offset


def stage_root() -> Path:
    """Where buckets are staged for SGLang to read: /dev/shm (memory) where there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def remove_stale_stages(root: Path) -> None:
    """Staging directories of actors that died without shutdown (tmpfs keeps them until reboot)."""
    for path in root.glob("tether-sglang-*-*"):
        try:
            os.kill(int(path.name.split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass


# ------------------------------------------------------------ the actor
class SglangEngineActor(EngineBackend):
    def __init__(self, model_path: str, cfg: dict, dtype: str = "bfloat16", seed: int = 0, host: str = "127.0.0.1",
                 log_dir: str = "outputs/engines", request_timeout_s: float = 600.0, attach_url: str | None = None,
                 limits: ServerLimits = DEFAULT_LIMITS, lora: dict | None = None, device: str = "cuda",
                 threads: int = 0):
        """Starts SGLang on a free port; with ``attach_url``, uses a server already running there instead.
        ``lora``: the run's model.lora when its pushes are the adapters (engine.lora_updates: adapter):
        SGLang serves the policy as that LoRA of the base, and the rollout names it in every request
        (engine/backends.py's request_fields). ``device`` and ``threads`` are SGLang's own business."""
        self.cfg = SglangConfig.model_validate(cfg)
        self.model_path, self.dtype = model_path, dtype
        self.lora = LoRAConfig.model_validate(lora) if lora is not None else None
        self._adapter: dict[str, torch.Tensor] = {}  # this push's adapter tensors, until the commit
        self._adapter_path: Path | None = None
        self._adapter_pushes = 0
        self.weight_version = 0
        self.released: set[str] = set()
        self._lock = threading.Lock()  # one bucket at a time through the stage directory
        self._segment = SegmentReader()  # the trainer's staging segment, when it is on this host
        self._client = sync_client(request_timeout_s, headers=engine_headers())
        self._ready, self.startup_s, self.last_load_s = False, 0.0, 0.0
        root = stage_root()
        remove_stale_stages(root)
        self._stage = Path(tempfile.mkdtemp(prefix=f"tether-sglang-{os.getpid()}-", dir=root))
        self.server: ServerProcess | None = None
        if attach_url is not None:
            self._url = self.sglang_url = attach_url.rstrip("/")
            return
        port = free_port("0.0.0.0" if host == "0.0.0.0" else "127.0.0.1")
        self.sglang_url = f"http://127.0.0.1:{port}"
        log = Path(log_dir).resolve() / f"sglang_{os.getpid()}.log"
        served = None
        if self.lora is not None:
            shapes = adapter_shapes(model_path, self.lora)
            served = (self.lora.rank, sorted({n.rpartition(".lora_")[0].rpartition(".")[2] for n in shapes}))
        args = launch_args(model_path, port, self.cfg, dtype, seed, host, limits.api_key, served)
        self.server = ServerProcess("SGLang server", args, self.cfg.python, dict(self.cfg.env), log,
                                    f"{self.sglang_url}/health")
        self._url = f"http://{node_address() if host == '0.0.0.0' else host}:{port}"

    @classmethod
    def attach(cls, url: str, cfg: dict | None = None, model_path: str = "", **kwargs: Any) -> SglangEngineActor:
        """An actor for an SGLang-compatible server already listening at ``url`` (started elsewhere);
        ``model_path``: the model it serves (needed to serve a LoRA policy: the adapters' shapes)."""
        return cls(model_path, cfg or {}, attach_url=url, **kwargs)

    # ------------------------------------------------------------ lifecycle
    def url(self) -> str:
        return self._url

    def health(self) -> dict:
        if not self._ready:
            if self.server is not None:
                self.startup_s = self.server.wait_healthy(self.cfg.startup_timeout_s)
            else:
                check_reply(self._client.get(f"{self.sglang_url}/health"), "GET /health")
            if self.lora is not None:  # adapters that change nothing until the first push
                zero = save_zero_adapter(self.model_path, self.lora, DTYPES.get(self.dtype, torch.bfloat16),
                                         self._stage / "adapter-push0")
                self._load_adapter(zero)
            self._ready = True
        if self.server is not None and not self.server.alive():
            raise RuntimeError(f"the SGLang server exited; its log ends with:\n{self.server.log_tail()}")
        return {"url": self._url, "pid": os.getpid(), "server_pid": self.server.proc.pid if self.server else None,
                "backend": "sglang", "weight_version": self.weight_version, "released": sorted(self.released),
                "startup_s": self.startup_s, "log": str(self.server.log_path) if self.server else None}

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._segment.close()
        self._client.close()
        shutil.rmtree(self._stage, ignore_errors=True)

    def _post(self, path: str, body: dict) -> dict:
        return check_reply(self._client.post(f"{self.sglang_url}{path}", json=body), f"POST {path}")

    # ------------------------------------------------------------ memory
    def release_memory(self, tags: list[str]) -> None:
        """Released weights come back with the next push (SGLang keeps no copy without
        --enable-weights-cpu-backup)."""
        body = memory_body(tags)
        self._post("/release_memory_occupation", body)
        self.released |= set(body["tags"])

    def resume_memory(self, tags: list[str]) -> None:
        body = memory_body(tags)
        self._post("/resume_memory_occupation", body)
        self.released -= set(body["tags"])

    # ------------------------------------------------------------ weights
    def _load_adapter(self, folder: Path) -> None:
        """SGLang serves the adapters in ``folder`` as LORA_NAME from here on. It loads a name once, so
        the previous adapters are unloaded first (a push happens with no request running: the loops
        push between rollouts, or with generation paused)."""
        if self._adapter_path is not None:
            self._post("/unload_lora_adapter", {"lora_name": LORA_NAME})
            shutil.rmtree(self._adapter_path, ignore_errors=True)
        self._post("/load_lora_adapter", lora_body(folder))
        self._adapter_path = folder

    def _commit_adapter(self) -> int:
        """The adapters this push delivered, written as a PEFT folder next to the base's and loaded."""
        if not self._adapter or self._adapter_path is None:
            return 0
        self._adapter_pushes += 1
        folder = self._stage / f"adapter-push{self._adapter_pushes}"
        folder.mkdir()
        count = len(self._adapter)
        write_safetensors(folder / ADAPTER_WEIGHTS, self._adapter)
        shutil.copy(self._adapter_path / ADAPTER_CONFIG, folder / ADAPTER_CONFIG)
        self._adapter = {}
        self._load_adapter(folder)
        return count

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """Tensors into the server: a safetensors file in the stage directory, /update_weights_from_disk,
        the file removed. Adapter tensors (PEFT's names) are kept for the commit instead. Call with the
        lock held."""
        adapter = {n: t.detach().cpu().clone() for n, t in tensors.items() if n.startswith(PEFT_PREFIX)}
        if adapter:
            self._adapter.update(adapter)
            tensors = {n: t for n, t in tensors.items() if n not in adapter}
        if not tensors:
            return len(adapter)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        room = shared_memory_room(str(self._stage))
        if room is not None and room < need:
            raise MemoryError(f"{self._stage} has {room / 2**20:.0f} MB free, a weight bucket needs {need / 2**20:.0f} MB "
                              "(a smaller cluster.weight_sync_bucket_mb, more /dev/shm, or cluster.weight_sync: distributed)")
        start = time.perf_counter()
        path = self._stage / BUCKET_FILE
        try:
            write_safetensors(path, tensors)
            self._post("/update_weights_from_disk", disk_update_body(self._stage))
        finally:
            path.unlink(missing_ok=True)
        self.last_load_s = time.perf_counter() - start
        return len(tensors)

    def load_weight_bucket(self, bucket: SharedBucket | PackedBucket, version: int, overlapped: bool = False) -> int:
        """One bucket from ObjectStoreSender (its shared-memory segment on this host, else the object
        store); SGLang serves with it from here on, labelled ``version`` from the commit on."""
        with self._lock:
            tensors = self._segment.tensors(bucket) if isinstance(bucket, SharedBucket) else unpack_bucket(bucket)
            return self.load_tensors(tensors)

    def commit_weights(self, version: int) -> int:
        with self._lock:
            self._commit_adapter()
            self._post("/update_weight_version", version_body(version))
            self.weight_version = version
            self.released.discard(WEIGHTS)
        return version
