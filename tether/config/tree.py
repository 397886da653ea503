"""One typed config tree for a tether run.

A recipe is a YAML file whose sections mirror the classes below; command-line overrides use
dotted paths (``rollout.temperature=0.7``). Everything is validated at load: an unknown key, a wrong
type or an inconsistent combination raises ``ConfigError`` naming the field (and the file). Nothing
here silently changes a value the user wrote. This module imports without torch or Ray so that
``tether train --dry-run`` is instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from tether.algorithms.config import AlgorithmConfig, CriticConfig, TeacherConfig
from tether.config.base import Section
from tether.config.raw import apply_overrides, resolve_function_specs
from tether.models.lora_config import LoRAConfig
from tether.engine.config import (EmbeddedEngineConfig, EngineConfig, ExternalEnginesConfig, ServedModelConfig,
                                  ServerConfig, SglangConfig, VllmConfig)
from tether.rollout.difficulty_config import DifficultyConfig
from tether.rollout.reasoning_gym_config import ReasoningGymData, ReasoningGymEval, check_eval_sources
from tether.rollout.config import RolloutConfig
from tether.errors import ConfigError


LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ClusterConfig(Section):
    num_train_actors: int = Field(1, ge=1)
    """Trainer processes (Ray actors) forming one torch.distributed group (data parallel, FSDP2)."""
    num_engines: int = Field(1, ge=1)
    """Inference engine actors used for rollout and eval."""
    colocate: bool = True
    """Place trainer and engines on the same bundles (they take turns); off: separate bundles."""
    offload: bool = False
    """With colocate: release engine memory while training and trainer memory while generating."""
    cpus_per_bundle: float = Field(1.0, gt=0)
    """Logical CPUs reserved per placement-group bundle (one bundle per trainer rank / engine)."""
    gpus_per_bundle: float = Field(0.0, ge=0)
    """GPUs per bundle; 0 runs everything on CPU (gloo, embedded engine)."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads per actor; 0 picks cores / busy actors."""
    ray_address: str | None = None
    """Join an existing Ray cluster (also read from RAY_ADDRESS); None starts a local one."""
    ray_num_cpus: int | None = None
    """Logical CPUs of a locally started Ray (None: enough for the layout)."""
    weight_sync: Literal["object_store", "distributed"] = "object_store"
    """How weights reach the engines: Ray object store buckets (shared memory on one host), or a
    torch.distributed broadcast group (gloo on CPU, NCCL on GPU) through the engines' HTTP API."""
    weight_sync_bucket_mb: float = Field(256.0, gt=0)
    """Weights travel in buckets of at most this many MB (a larger tensor goes alone, never split); the
    engines load one bucket while the next is sent. Staging holds two buckets (with object_store and
    engines on the trainer's host, in a shared-memory segment kept between pushes)."""
    call_timeout_s: float = Field(600.0, gt=0)
    """Upper bound for any single remote call (generate, train, save); a stuck call raises."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """torch.distributed timeout for collectives between trainer ranks."""
    engine_health_interval_s: float = Field(2.0, gt=0)
    """While a rollout or eval generates, every engine is asked for a one-token generation
    (/health_generate) this often."""
    engine_health_timeout_s: float = Field(30.0, gt=0)
    """An engine that does not answer its heartbeat within this is lost (dead or frozen): it gets no more
    requests, and those it held go to the other engines."""
    max_engine_restarts: int = Field(3, ge=0)
    """Lost engines replaced in a run (a new engine actor on the lost one's bundle, given the trainer's
    current weights); one more loss ends the run naming the engine. 0: the first lost engine ends it."""
    api_key: str | None = None
    """Bearer token that tether's servers ask for on control routes (weight updates, memory, pause/abort,
    flush; with server.require_key_for_generate on every route but /health) and tether's clients send.
    Needed when engine.host is not loopback. None: the TETHER_API_KEY environment variable,
    which keeps it out of config files (the config a run writes never holds the key)."""
    router: Literal["builtin", "sglang_router"] = "builtin"
    """What spreads requests over the engines: tether's router (least-loaded, in the rollout manager), or
    the sglang-router package's cache-aware router (prefix-aware placement for multi-turn rollouts),
    started as a process in front of the engines."""


class ModelConfig(Section):
    path: str
    """A local directory with an HF causal LM (config.json, weights, tokenizer), or a Hugging Face Hub id
    (org/name[@revision]): taken from the local HF cache, downloaded when not there and the network allows.
    A GGUF file is converted first: tether import-gguf FILE DIR."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of trainer and engine. float32 makes engine and trainer log-probs identical."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the linear layers instead of every weight (docs/lora.md); None: full
    fine-tuning."""


class DataConfig(Section):
    path: str | None = None
    """Prompts for RL: a JSONL or Parquet file, an Arrow file, a folder written by Hugging Face's
    Dataset.save_to_disk, or a Hub dataset as hf://datasets/<owner>/<name> (docs/your-task.md)."""
    split: str = "train"
    """The split of a Hub dataset (hf://datasets/...)."""
    subset: str | None = None
    """The subset (configuration) of a Hub dataset, e.g. "main" for openai/gsm8k."""
    reasoning_gym: ReasoningGymData | None = None
    """Prompts generated by the reasoning-gym package instead of read from path: written at start-up as
    JSONL to <output_dir>/data/ (tether/rollout/reasoning_gym_files.py), which path then names. Score
    them with rollout.reward: reasoning_gym (docs/your-task.md: Tasks from reasoning-gym)."""
    prompt_key: str = "prompt"
    """Row key of the prompt (a string, or a list of chat messages); a dotted key reaches a nested field."""
    label_key: str = "label"
    """Row key of the label the reward compares against; a dotted key reaches a nested field (verl's rows:
    reward_model.ground_truth). A row without it stops the start (file and line) when this is set or the
    reward compares labels (math, exact_match, f1); otherwise its label is None."""
    metadata_key: str = "metadata"
    """Row key of an optional dict passed to the reward."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (adds the generation prompt)."""
    prompt_template: str | None = None
    """Format each prompt with this str.format template before the chat template, e.g. "{prompt} =";
    {prompt} is the prompt field and any other {key} is that field of the row. Literal braces are
    doubled ("\\boxed{{}}"). With chat messages it formats the last user message. None: as is."""
    response_prefix: str = ""
    """Text appended after the (chat-formatted) prompt, so every response starts after it (e.g. "Answer:");
    it is part of the prompt tokens, not of the response the reward sees."""
    max_prompt_len: int | None = Field(None, ge=1)
    """Drop prompts longer than this many tokens (counted and reported)."""
    shuffle: bool = True
    """Shuffle prompts each epoch, deterministically from (seed, epoch)."""
    skip_bad_rows: bool = False
    """Skip a malformed row (bad JSON, missing or ill-typed fields, an empty prompt, one the model's
    positions cannot hold with the response, a label the reward cannot score) and count it, instead of
    stopping before the run starts with its file and line. Applies to the eval datasets too."""
    difficulty: DifficultyConfig | None = None
    """Train where the model has signal: problems' pass rates measured before the run and a band of
    them kept, and a curriculum over difficulty levels (tether/rollout/difficulty_config.py). None: every
    problem, in the data's order."""

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, template: str | None) -> str | None:
        if template is not None:
            from tether.rollout.prompt_format import template_fields

            if not template_fields(template):
                raise ValueError(f"{template!r} has no field: add {{prompt}} where the prompt goes")
        return template

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and self.reasoning_gym is not None:
            raise ValueError("give data.path or data.reasoning_gym, not both")
        curriculum = self.difficulty is not None and self.difficulty.curriculum is not None
        if curriculum and self.reasoning_gym is not None and self.reasoning_gym.levels is None:
            raise ValueError("difficulty.curriculum draws problems by level: set data.reasoning_gym.levels "
                             "(how many of each task's levels to generate)")
        return self


class TrainConfig(Section):
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (all ranks). None: one step per rollout (the whole rollout batch)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward on one rank; gradients accumulate up to the global batch. At most the
    samples a rank has per optimizer step. None: 8 (or all of a rank's samples, when it has fewer)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Pack samples without padding into micro-batches of about this many tokens each (replaces
    micro_batch_size), with ranks balanced by tokens (tether/trainer/micro_batches.py). None: off."""
    share_prompts: bool = True
    """Samples that begin with the same tokens (a group's prompt) are laid out so those tokens are
    computed once in every trainer pass (forward, backward, old and reference log-probs), each response
    attending to the prompt and to itself (tether/trainer/shared_prefix.py); values equal the unshared
    layout's to float rounding. A group stays on one rank and in one micro-batch where it fits. False:
    one sample per row (or packed), each with its own copy of the prompt."""
    attention: Literal["auto", "sdpa", "eager", "flex_attention"] = "auto"
    """The trainer's attention implementation (transformers' attn_implementation). auto: SDPA, and eager
    attention for bfloat16 training on CPU (faster there). flex_attention skips the masked blocks of
    share_prompts' layout (on GPUs; it compiles its kernels on first use, about a minute on a CPU)."""
    logits_chunk_mb: float = Field(256.0, ge=0)
    """Log-probs and entropy come from the LM head at response positions only, in chunks of tokens whose
    float32 logits take about this many MB, recomputed in backward (tether/trainer/head.py): memory of one
    chunk instead of a micro-batch's whole [tokens, vocabulary] logits. 0: the model's whole logits at once."""
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate (AdamW)."""
    min_lr: float = Field(0.0, ge=0)
    """Final learning rate of the cosine schedule."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Shape after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 over this many optimizer steps."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0: no clipping, the norm is still logged)."""
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    """Mixed precision: the trainer's forward and backward passes (policy, reference, critic) run with
    the parameters cast to this dtype, while the weights, AdamW's state and the checkpoints stay in
    model.dtype, gradients are reduced in float32, and log-probs and losses are computed in float32
    (FSDP2's MixedPrecisionPolicy). The engines keep model.dtype. None: compute in model.dtype.
    bfloat16 runs matmuls about 2x faster on CPUs with AVX-512 BF16 and on GPUs; the trainer's
    log-probs then differ from float32 engines' by about 1e-2 (logged as mismatch)."""
    skip_nonfinite_steps: int = Field(0, ge=0)
    """An optimizer step whose loss or gradient norm is NaN/inf is never applied. 0: the run stops
    with an error naming the rollout, the loss term and the first non-finite tensor; N > 0: such a
    step is skipped with a warning, and the run stops when more than N come in a row."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """0 decodes greedily."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Keep the k most likely tokens (-1: all)."""
    max_response_len: int = Field(64, ge=1)
    """Maximum new tokens per response."""
    n_samples_per_prompt: int = Field(1, ge=1)
    """Responses per eval prompt; the score is their mean reward (mean@n), and with n > 1 pass@k is
    reported for k = 1..n (powers of two and n when n > 8)."""
    pass_threshold: float = 1.0
    """A response passes (for pass@k and the per-prompt pass rates) when its reward is at least this."""


class EvalDatasetConfig(SamplingConfig):
    name: str | None = None
    """Name used in metrics (eval/<name>/score). Required, except for a reasoning_gym set with per_task,
    whose sets are named by their tasks (with this as a prefix when given)."""
    path: str | None = None
    """Eval prompts (any source data.path takes), read with the data section's keys."""
    split: str = "test"
    """The split of a Hub dataset (hf://datasets/...; its subset is data.subset)."""
    reasoning_gym: ReasoningGymEval | None = None
    """Problems generated by reasoning-gym instead of read from path (by default the tasks of
    data.reasoning_gym, held out from its problems); written to <output_dir>/data/ at start-up."""
    reward: str | None = None
    """Reward for this dataset; None uses rollout.reward."""

    @model_validator(mode="after")
    def _one_source(self) -> EvalDatasetConfig:
        if (self.path is None) == (self.reasoning_gym is None):
            raise ValueError("give path or reasoning_gym (one of them)")
        if self.name is None and not (self.reasoning_gym is not None and self.reasoning_gym.per_task):
            raise ValueError("name is required (only a reasoning_gym set with per_task is named by its tasks)")
        return self


class EvalConfig(Section):
    interval: int | None = Field(None, ge=1)
    """Evaluate every this many rollouts (and before the first one and after the last). None: never."""
    datasets: list[EvalDatasetConfig] = []
    """Named eval sets, each with its own sampling settings."""


class CheckpointConfig(Section):
    save_dir: str | None = None
    """Where checkpoints go (default: <output_dir>/checkpoints)."""
    save_interval: int | None = Field(None, ge=1)
    """Save every this many rollouts (and always at each epoch end and the last rollout)."""
    keep_last: int | None = Field(None, ge=1)
    """Keep only this many newest checkpoints (None: keep all)."""
    load: str | None = None
    """Resume from the latest complete checkpoint in this directory."""
    allow_config_change: list[str] = []
    """Fields (dotted paths) you mean to change when resuming, beyond the always-allowed ones."""
    export_hf: bool = True
    """Write an HF-format model (safetensors + tokenizer) to <output_dir>/hf at the end."""
    auto_resume: int = Field(0, ge=0)
    """When a trainer or engine process dies (or a call times out), restart the whole run from the
    latest complete checkpoint, in the same process, up to this many times (0: stop with the error)."""


class TrackingConfig(Section):
    run_name: str | None = None
    """Run name (default: the output directory's name)."""
    jsonl: bool = True
    """Write metrics.jsonl."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    wandb: bool = False
    """Log to Weights & Biases (needs the wandb extra)."""
    wandb_project: str = "tether"
    """W&B project."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; None lets W&B decide as it always does (WANDB_MODE, else online when logged in);
    offline writes locally for a later `wandb sync`."""
    console: bool = True
    """Print one line per rollout."""


class DebugConfig(Section):
    save_rollouts: str | None = None
    """Where each rollout is written as rollout_<id>.jsonl (every field needed to train on it again:
    tokens, loss masks, log-probs, rewards) and eval samples beside them. None: <output_dir>/rollouts."""
    keep_rollout_dumps: int | None = Field(8, ge=1)
    """During `tether train`, keep the files of only this many most recent rollouts (and evals per eval
    set) in the rollouts directory, so that a long run cannot fill the disk with them; None keeps all.
    `tether rollout` keeps every one (it exists to save them). To replay a whole run later with
    debug.load_rollouts, set None."""
    load_rollouts: str | None = None
    """Train on rollouts saved earlier (a directory of rollout_<id>.jsonl, from a run or `tether
    rollout`) instead of generating: no engines start, rollout k reads rollout_<k>.jsonl, eval is off."""


class SFTConfig(Section):
    path: str | None = None
    """Rows with prompt and response, or messages (supervised fine-tuning): any source data.path takes."""
    split: str = "train"
    """The split of a Hub dataset (hf://datasets/...; its subset is data.subset)."""
    prompt_key: str = "prompt"
    """Row key of the prompt."""
    response_key: str = "response"
    """Row key of the target response; the loss covers only these tokens (and the eos)."""
    messages_key: str = "messages"
    """Row key of a chat conversation ([{"role", "content"}, ...], TRL's conversational format): a row with
    it is rendered with the chat template and trained on its assistant turns only (instead of prompt and
    response)."""
    num_epoch: int = Field(1, ge=1)
    """Passes over the SFT data."""
    batch_size: int = Field(32, ge=1)
    """Samples per optimizer step (all ranks)."""


class TetherConfig(Section):
    output_dir: str = "outputs/run"
    """Everything a run writes: metrics, plots, checkpoints, the exported model."""
    seed: int = Field(0, ge=0)
    """Seeds data order, sampling and initialisation."""
    deterministic: bool = False
    """Deterministic kernels everywhere: two runs with the same seed give bitwise identical weights (CPU)."""
    cluster: ClusterConfig = ClusterConfig()
    """Ray, placement and process layout."""
    model: ModelConfig
    """The policy model."""
    data: DataConfig = DataConfig()
    """Prompt data for RL."""
    rollout: RolloutConfig = RolloutConfig()
    """How many rollouts, how big, how responses are sampled and scored."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantage estimator, policy loss, KL and entropy terms."""
    train: TrainConfig = TrainConfig()
    """Optimizer, schedule and batching of the trainer."""
    critic: CriticConfig = CriticConfig()
    """The value model of PPO (used when algorithm.advantage_estimator is gae)."""
    eval: EvalConfig = EvalConfig()
    """Evaluation datasets and interval."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Saving, resuming and exporting."""
    tracking: TrackingConfig = TrackingConfig()
    """Metrics destinations."""
    engine: EngineConfig = EmbeddedEngineConfig()
    """The inference backend and its settings, keyed on ``backend``: embedded (tether's PyTorch engine),
    vllm, sglang, or external (servers already running). All speak one HTTP contract
    (tether/engine/base.py); each backend's actor and placement facts are in tether/engine/backends.py."""
    server: ServerConfig = ServerConfig()
    """Limits of tether's HTTP servers (engines, the vLLM adapter, chat sessions)."""
    teacher: TeacherConfig | None = None
    """On-policy distillation from a served model (docs/distillation.md); None: off."""
    served_models: dict[str, ServedModelConfig] = {}
    """Models served beside the policy that never take weight pushes (a judge, a reward model), by name:
    reward functions take them as a parameter named ``models``, generate functions as ``ctx.models``
    (docs/served-models.md)."""
    sft: SFTConfig = SFTConfig()
    """Supervised fine-tuning data (`tether sft`)."""
    debug: DebugConfig = DebugConfig()
    """Saving rollouts, and training on saved ones."""
    args: dict[str, Any] = {}
    """Your functions' own settings, free-form (a table path, a sandbox image, a tool's limits): a
    reward, group reward, post-process or filter function with a parameter named ``args`` gets this
    dict; generate and rollout functions read it as ``ctx.args``. Overrides reach into it
    (``args.table=data/t.json``)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            if isinstance(raw.get("engine"), dict) and "backend" not in raw["engine"]:
                raw = {**raw, "engine": {"backend": "embedded", **raw["engine"]}}  # the default backend's settings
            old = [k for k in ("vllm", "sglang") if k in raw]
            if old:
                raise ValueError(f"the {' and '.join(old)} section(s) moved into the engine section, keyed on its "
                                 f"backend: write engine: {{backend: {old[0]}, <the same fields>}}")
        return raw

    @model_validator(mode="after")
    def _check_consistency(self) -> TetherConfig:
        samples = self.rollout.prompts_per_rollout * self.rollout.n_samples_per_prompt
        gbs = self.train.global_batch_size
        if gbs is not None and samples % gbs != 0:
            raise ValueError(
                f"train.global_batch_size={gbs} must divide the rollout batch "
                f"(rollout.prompts_per_rollout * rollout.n_samples_per_prompt = {samples})"
            )
        if gbs is not None and gbs % self.cluster.num_train_actors != 0:
            raise ValueError(
                f"train.global_batch_size={gbs} must be divisible by cluster.num_train_actors="
                f"{self.cluster.num_train_actors}"
            )
        per_rank = (gbs or samples) // self.cluster.num_train_actors
        mbs = self.train.micro_batch_size
        if mbs is not None and self.train.max_tokens_per_micro_batch is None and mbs > per_rank:
            raise ValueError(f"train.micro_batch_size={mbs} is larger than the samples a rank "
                             f"has per optimizer step ({per_rank}: train.global_batch_size={gbs or samples} over "
                             f"{self.cluster.num_train_actors} train actor(s)); a micro-batch cannot hold more")
        if self.deterministic and self.rollout.keep_order == "finish":
            raise ValueError("rollout.keep_order: finish depends on which group finishes first; it cannot be "
                             "combined with deterministic: true (use keep_order: start)")
        if self.cluster.offload and not self.cluster.colocate:
            raise ValueError("cluster.offload=true needs cluster.colocate=true (only colocated parts take turns)")
        mode = self.rollout.schedule.mode
        if mode != "sync" and self.cluster.colocate:
            raise ValueError(f"rollout.schedule.mode: {mode} overlaps generation and training, "
                             "so engines need their own bundles: set cluster.colocate=false")
        self._check_async()
        self._check_engines()
        bad = [name for name in self.served_models if not name.replace("-", "_").isidentifier()]
        if bad:
            raise ValueError(f"served_models: names are written as ctx.models[name]: letters, digits, _ and -, got {bad}")
        if self.teacher is not None and self.teacher.model not in self.served_models:
            raise ValueError(f"teacher.model {self.teacher.model!r} is not a served model (served_models: "
                             f"{', '.join(sorted(self.served_models)) or 'none'})")
        if mode != "sync" and self.debug.load_rollouts is not None:
            raise ValueError(f"rollout.schedule.mode: {mode} overlaps generation with training; debug.load_rollouts "
                             "replays saved rollouts without engines: use one or the other")
        if self.train.min_lr > self.train.lr:
            raise ValueError(f"train.min_lr={self.train.min_lr} is larger than train.lr={self.train.lr}")
        buffer = self.rollout.overlong_buffer_len
        if buffer is not None and buffer > self.rollout.max_response_len:
            raise ValueError(f"rollout.overlong_buffer_len={buffer} is longer than "
                             f"rollout.max_response_len={self.rollout.max_response_len}")
        if self.algorithm.advantage_estimator == "rloo" and self.rollout.n_samples_per_prompt < 2:
            raise ValueError("algorithm.advantage_estimator=rloo needs rollout.n_samples_per_prompt >= 2")
        names = check_eval_sources(self.data.reasoning_gym, self.eval.datasets)
        if len(set(names)) != len(names):
            raise ValueError(f"eval.datasets names must be unique, got {names}")
        return self

    def _check_async(self) -> None:
        r = self.rollout
        if r.schedule.mode != "fully_async":
            return
        # Generate functions, dynamic filters, over-sampling and partial rollout stream like plain groups
        # (the stream always continues a group cut by a weight update). What is left cannot stream:
        reasons = {
            "rollout.custom_rollout_fn": (r.custom_rollout_fn, "a rollout function produces a whole rollout at "
                                          "once, while the stream hands the trainer groups as they finish; use "
                                          "rollout.custom_generate_fn for per-group logic"),
            "rollout.keep_order": (r.keep_order != "start" and r.keep_order, "the stream always takes the ready "
                                   "groups with the oldest weights first"),
            "deterministic": (self.deterministic, "which groups a take gets depends on when they finish, "
                              "against the trainer's pace"),
            "data.difficulty": (self.data.difficulty is not None and "set", "the stream draws prompts in the "
                                "data's own order; the band and the curriculum draw from the pass rates and "
                                "levels of rollouts as they are trained, which the synchronous and one-step-off "
                                "schedules keep in step"),
        }
        named = [f"{name}={value} ({why})" for name, (value, why) in reasons.items() if value]
        if named:
            raise ValueError("rollout.schedule.mode: fully_async streams groups across train steps; it does not "
                             "combine with " + "; ".join(named))

    def _check_engines(self) -> None:
        e, c = self.engine, self.cluster
        host = getattr(e, "host", "127.0.0.1")
        if host not in LOOPBACK and not (c.api_key or os.environ.get("TETHER_API_KEY")):
            raise ValueError(f"engine.host={host} lets other machines reach the engines' control "
                             "routes (weight updates, memory, abort): set cluster.api_key or TETHER_API_KEY")
        if c.router == "sglang_router" and self.server.require_key_for_generate:
            raise ValueError("server.require_key_for_generate with cluster.router: sglang_router: the router's requests "
                             "to the engines carry no key; use the builtin router")
        if e.gpu_only and not c.gpus_per_bundle:
            raise ValueError(f"engine.backend: {e.backend} runs on GPUs only: set cluster.gpus_per_bundle, or use "
                             "engine.backend: embedded or vllm on CPU")
        if isinstance(e, VllmConfig) and e.lora_updates == "adapter" and self.model.lora and self.model.lora.rank > 512:
            raise ValueError(f"model.lora.rank={self.model.lora.rank}: vLLM serves LoRA ranks up to 512; set "
                             "engine.lora_updates: merged to push merged weights instead")
        if (isinstance(e, SglangConfig) and e.lora_updates == "adapter" and self.model.lora
                and c.weight_sync == "distributed"):
            raise ValueError("engine.lora_updates: adapter with engine.backend: sglang loads the adapters from a folder "
                             "the engine actor writes, so they cannot arrive over cluster.weight_sync: distributed "
                             "(SGLang's workers would load them as model weights): use object_store, or "
                             "engine.lora_updates: merged")
        if not isinstance(e, ExternalEnginesConfig):
            return
        if len(e.urls) != c.num_engines:
            raise ValueError(f"engine.urls lists {len(e.urls)} server(s) but "
                             f"cluster.num_engines={c.num_engines}: make them agree")
        if c.colocate or c.weight_sync != "distributed":
            raise ValueError("engine.backend: external servers run outside the placement group and have no Ray "
                             "actor to take object-store buckets: set cluster.colocate=false and "
                             "cluster.weight_sync=distributed")

    @property
    def external_engines(self) -> list[str]:
        """URLs of engine servers tether did not start (engine.backend: external), else none."""
        return list(self.engine.urls) if isinstance(self.engine, ExternalEnginesConfig) else []

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, resolved (the whole rollout batch when unset)."""
        return self.train.global_batch_size or self.rollout.prompts_per_rollout * self.rollout.n_samples_per_prompt

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.save_dir or Path(self.output_dir) / "checkpoints")


# ---------------------------------------------------------------- loading


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in err.errors():
        field = ".".join(str(p) for p in item["loc"]) or "<root>"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown field (typo?)"
        got = item.get("input")
        shown = "" if item["type"] in ("missing",) or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {field}: {msg}{shown}")
    return "\n".join(lines)


def config_from_dict(raw: dict, source: str = "<dict>") -> TetherConfig:
    try:
        return TetherConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TetherConfig:
    """Read a YAML recipe, apply ``section.field=value`` overrides, validate."""
    raw: dict = {}
    source = "command line"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.MarkedYAMLError as err:  # the line and column where the parser gave up
            mark = err.problem_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            context = f" ({err.context} at line {err.context_mark.line + 1})" if err.context and err.context_mark else ""
            raise ConfigError(f"{where}: not valid YAML: {err.problem}{context}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        resolve_function_specs(raw, path.resolve().parent)
    raw = resolve_function_specs(apply_overrides(raw, overrides or []), Path.cwd())
    if overrides:
        source += " with overrides " + " ".join(overrides)
    return config_from_dict(raw, source)


def public_dict(cfg: TetherConfig) -> dict:
    """The config as written to files, logs and trackers: every value but the API key."""
    raw = cfg.model_dump(mode="json")
    if raw["cluster"]["api_key"] is not None:
        raw["cluster"]["api_key"] = "<redacted>"
    return raw


def dump_config(cfg: TetherConfig) -> str:
    """The resolved config as YAML (what --dry-run prints and checkpoints store), without the API key."""
    return yaml.safe_dump(public_dict(cfg), sort_keys=False)
