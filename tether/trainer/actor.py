"""The train actor: one rank of the trainer. Holds model, reference model, optimizer and schedule.

Coarse methods only (init, train, push_weights, save, save_hf, offload/onload); the driver calls
them on all ranks at once through TrainerGroup. Collectives run over gloo on CPU and NCCL on GPU.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tether.algorithms.advantages import NEEDS_VALUES, AdvantageParams
from tether.algorithms.losses import LossParams
from tether.trainer.batch import TrainBatch
from tether.run.checkpoint import load_trainer, read_meta, save_trainer
from tether.config import TetherConfig, config_from_dict
from tether.trainer.critic import Critic
from tether.models.hf import load_model, load_tokenizer
from tether.models.lora import adapter_tensors, has_lora, merged_tensors, trainable_count
from tether.trainer.model import prepare_for_training, save_hf
from tether.trainer.optim import build_optimizer, build_scheduler
from tether.trainer.nonfinite import NonFiniteGuard
from tether.trainer.shared_prefix import unit_token_limit
from tether.trainer.step import StepSettings, TrainState, response_logprobs, train_steps
from tether.engine.base import node_address
from tether.engine.backends import ADAPTER, LAYERS, WHOLE, engine_ranks, lora_push
from tether.errors import EnginesLostInPush
from tether.weight_sync.base import WeightSender
from tether.weight_sync.distributed import DistributedSender
from tether.weight_sync.group import tcp_store

ENGINE_PROBE_S = 10.0
"""After a failed push, how long an engine actor has to answer before it counts as lost."""

if TYPE_CHECKING:
    from transformers import PreTrainedModel


TRAINED_SAMPLES = "trained_samples.jsonl"
DEFAULT_MICRO_BATCH = 8  # train.micro_batch_size unset: a smaller batch simply makes one micro-batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainActor:
    def __init__(self, cfg_dict: dict, rank: int, world_size: int, threads: int = 0):
        self.cfg: TetherConfig = config_from_dict(cfg_dict, "train actor")
        self.rank, self.world = rank, world_size
        self.device = "cuda" if self.cfg.cluster.gpus_per_bundle > 0 else "cpu"
        if threads:
            torch.set_num_threads(threads)
        if self.cfg.deterministic:
            # CUDA's cuBLAS needs a fixed workspace for deterministic matmuls; harmless on CPU.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.sender: WeightSender | None = None
        self.engines: list[Any] = []  # weight-sync targets: engine actors, and their servers' URLs
        self.engine_urls: list[str] = []
        self.policy_version = 0  # the version of the weights as they are now (pushed or about to be)
        self.ref_model: PreTrainedModel | None = None
        self.critic: Critic | None = None
        self.guard = NonFiniteGuard(self.cfg.train.skip_nonfinite_steps)  # counts bad steps across calls

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup_distributed(self, master_addr: str, master_port: int) -> None:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        # On GPUs, gloo beside NCCL: the scalar metric reductions and the non-finite checks reduce
        # small CPU tensors, which NCCL alone refuses.
        backend = "cpu:gloo,cuda:nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
        timeout = timedelta(seconds=self.cfg.cluster.collective_timeout_s)
        store = tcp_store(master_addr, master_port, self.world, self.rank == 0, timeout)  # on master_addr only
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.mesh = init_device_mesh(self.device, (self.world,))

    def init(self, total_steps: int, with_ref: bool, load_dir: str | None) -> None:
        """Build model (+ reference), optimizer and schedule; load a checkpoint when given."""
        seed_everything(self.cfg.seed)
        self.tokenizer = load_tokenizer(self.cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        model = load_model(self.cfg.model.path, self.cfg.model.dtype, self.device)
        self.model = prepare_for_training(model, self.cfg, self.mesh, self.device)
        if self.rank == 0 and has_lora(self.model):
            trained, total = trainable_count(self.model)
            print(f"LoRA: {trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%)", flush=True)
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train, total_steps)
        if with_ref and has_lora(self.model):
            # The base with the adapters off is the starting policy: no second copy (step.py's reference pass).
            self.ref_model = self.model
        elif with_ref:
            # The reference is the starting policy, frozen: KL is measured against where we began.
            ref = load_model(self.cfg.model.path, self.cfg.model.dtype, self.device).eval()
            ref.requires_grad_(False)
            self.ref_model = prepare_for_training(ref, self.cfg, self.mesh, self.device, backward=False)
        if self.cfg.algorithm.advantage_estimator in NEEDS_VALUES:
            self.critic = Critic(self.cfg, self.device, self.mesh, total_steps)
        if load_dir:
            saved_world = read_meta(load_dir).get("train_world_size", self.world)
            load_trainer(Path(load_dir), self.model, self.optimizer, self.scheduler, self.rank, saved_world,
                         self.critic)

    def step_settings(self, policy_loss: str | None, global_batch_size: int) -> StepSettings:
        a, t = self.cfg.algorithm, self.cfg.teacher
        return StepSettings(
            micro_batch_size=self.cfg.train.micro_batch_size or DEFAULT_MICRO_BATCH,
            global_batch_size=global_batch_size,
            pad_id=self.pad_id,
            grad_clip=self.cfg.train.grad_clip,
            policy_loss=policy_loss or a.policy_loss,
            loss_params=LossParams(eps_clip_low=a.eps_clip_low, eps_clip_high=a.eps_clip_high,
                                   kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef,
                                   dual_clip_c=a.dual_clip_c, rollout_correction=a.rollout_correction,
                                   rollout_is_low=a.rollout_is_low, rollout_is_high=a.rollout_is_high,
                                   teacher_kl_coef=t.coef if t is not None and t.mode == "loss" else 0.0,
                                   teacher_kl_type=t.kl_type if t is not None else "k3"),
            advantage_estimator=a.advantage_estimator,
            advantage_params=AdvantageParams(gamma=a.gamma, lam=a.lam, kl_coef=a.kl_in_reward_coef),
            kl_in_reward_type=a.kl_in_reward_type,
            loss_agg_mode=a.loss_agg_mode,
            max_response_len=self.cfg.rollout.max_response_len,
            max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch,
            logits_chunk_mb=self.cfg.train.logits_chunk_mb,
            teacher_advantage_coef=t.coef if t is not None and t.mode == "advantage" else 0.0,
            share_prompts=self.cfg.train.share_prompts,
            device=self.device,
            max_unit_tokens=unit_token_limit(self.model),
        )

    def state(self) -> TrainState:
        """The policy, its optimizer and schedule, the reference, and the critic as the one objective
        beside the policy (none for GRPO and SFT)."""
        return TrainState(self.model, self.optimizer, self.scheduler, self.ref_model,
                          [self.critic] if self.critic is not None else [], self.guard)

    def train(self, step_id: int, batch: TrainBatch, policy_loss: str | None = None,
              global_batch_size: int | None = None) -> dict[str, float]:
        """All optimizer steps on one batch (a rollout, or an SFT batch with policy_loss='sft')."""
        start = time.perf_counter()
        self.model.train()
        settings = self.step_settings(policy_loss, global_batch_size or self.cfg.global_batch_size)
        what = f"rollout {step_id}" if batch.rewards is not None else f"sft step {step_id}"
        metrics = train_steps(self.state(), batch, settings, self.rank, self.world, what)
        metrics["timing/train_s"] = time.perf_counter() - start
        if batch.rewards is not None:
            self.policy_version = step_id + 1  # the version the push after this rollout gives the engines
            if self.rank == 0:
                self._log_trained(step_id, batch)
        return metrics

    def _log_trained(self, rollout_id: int, batch: TrainBatch) -> None:
        """Which samples each rollout trained on: the audit trail that resume tests compare."""
        path = Path(self.cfg.output_dir) / TRAINED_SAMPLES
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"rollout_id": rollout_id, "sample_ids": [list(s) for s in batch.sample_ids]}) + "\n")

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> list[list[float]]:
        """Log-probs of each response token under the current policy (diagnostics and tests)."""
        self.model.eval()
        settings = self.step_settings(None, len(batch))
        mine = list(range(len(batch)))
        out = response_logprobs(self.model, batch, [mine], settings)
        return [out[i].tolist() for i in mine]

    # ------------------------------------------------------------ weights
    def connect_engines(self, engines: list[Any], urls: list[str]) -> None:
        """Rank 0 sets up the weight transport to the engines (Ray handles, and their HTTP URLs)."""
        if self.rank == 0:
            self.engines, self.engine_urls = list(engines), list(urls)
            self.sender = self._sender(self.engines, self.engine_urls)

    def _sender(self, engines: list[Any], urls: list[str]) -> WeightSender:
        c = self.cfg.cluster
        bucket_bytes = int(c.weight_sync_bucket_mb * 2**20)
        if c.weight_sync == "distributed":
            return DistributedSender(urls, node_address(), backend="nccl" if self.device == "cuda" else "gloo",
                                     bucket_bytes=bucket_bytes, timeout_s=c.call_timeout_s, device=self.device,
                                     ranks_per_engine=engine_ranks(self.cfg))
        from tether.weight_sync.object_store import ObjectStoreSender  # Ray's: imported where it is used

        return ObjectStoreSender(engines, bucket_bytes=bucket_bytes, timeout_s=c.call_timeout_s)

    def push_weights(self, version: int) -> dict[str, float]:
        """Gather full weights (collective) and stream them from rank 0 to every engine."""
        self.policy_version = version
        if self.rank != 0:
            for _ in self._pushed(everything=False):  # other ranks take part in each gather
                pass
            return {}
        if not self.engine_urls:
            raise RuntimeError("push_weights before connect_engines")
        if self.sender is None:  # an engine was replaced: the transport is set up again for all
            self.sender = self._sender(self.engines, self.engine_urls)
        try:
            return self.sender.send(self._pushed(everything=False, device=self.sender.device), version)
        except Exception as err:  # noqa: BLE001 - an engine that died is named; any other failure stands
            dead = self._dead_engines()
            if not dead:
                raise
            self.sender.close()  # set up again, for the replacements too, by the next push
            self.sender = None
            raise EnginesLostInPush(dead, f"{type(err).__name__}: {str(err)[:500]}") from None

    def _dead_engines(self) -> list[int]:
        """Indices of the engine actors that are gone or do not answer /health (external servers are not
        ours to replace and are not asked)."""
        import ray

        dead = []
        for index, engine in enumerate(self.engines):
            try:
                ray.get(engine.health.remote(), timeout=ENGINE_PROBE_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(index)
        return dead

    def _pushed(self, everything: bool, device: str = "cpu"):
        """The gathered tensors a push sends, where the transport takes them (the object store from host
        memory, a broadcast from the device it runs on: NCCL's from the GPU, no trip through the host).

        With LoRA the base never changes (every engine loaded it from model.path), so what travels is
        what the backend takes (engine/backends.py): the adapters themselves to an engine serving them
        as a LoRA (vLLM's runtime LoRA route), the adapted layers' merged weights to one that takes
        some weights (the embedded engine, SGLang), the whole merged model to the rest. An engine that
        starts from nothing (one replaced, or one whose weights were released: offload) gets the whole
        merged model, unless it serves adapters: its base is model.path's.
        """
        mode = lora_push(self.cfg) if has_lora(self.model) else WHOLE
        if mode == ADAPTER:
            tensors = adapter_tensors(self.model)
        else:
            only_adapted = mode == LAYERS and not everything and not self.cfg.cluster.offload
            tensors = merged_tensors(self.model, only_adapted)
        return ((name, t.to(device)) for name, t in tensors)

    def replace_engine(self, index: int, engine: Any, url: str) -> dict[str, float]:
        """A new engine takes engine ``index``'s place: it gets the current weights (as version
        ``policy_version``) through a transport of its own, now, while the others generate; the
        next push sets the transport up again for every engine."""
        if self.rank != 0:
            for _ in self._pushed(everything=True):  # other ranks take part in each gather
                pass
            return {}
        self.engines[index], self.engine_urls[index] = engine, url
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        one_off = self._sender([engine], [url])
        try:
            return one_off.send(self._pushed(everything=True, device=one_off.device), self.policy_version)
        finally:
            one_off.close()

    # ------------------------------------------------------------ state
    def save(self, staging_dir: str) -> None:
        save_trainer(Path(staging_dir), self.model, self.optimizer, self.scheduler, self.rank, self.critic)

    def save_hf(self, out_dir: str) -> None:
        save_hf(self.model, self.tokenizer, self.cfg.model.path, out_dir, self.rank)

    def offload(self) -> None:
        """Move parameters and optimizer state off the accelerator (a no-op on a CPU-only run)."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: str) -> None:
        parts: list[tuple[nn.Module, torch.optim.Optimizer]] = [(self.model, self.optimizer)]
        if self.critic is not None:
            parts.append((self.critic.model, self.critic.optimizer))
        for model, optimizer in parts:
            model.to(device)
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        state[key] = value.to(device)
        if device == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
