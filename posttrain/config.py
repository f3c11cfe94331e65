"""The recipe schema: the single source of truth for every key a recipe may hold.

A recipe is YAML; `RunConfig` is its schema (pydantic, frozen, unknown keys forbidden) and holds
every default. `load_recipe` reads a file, applies dotted command-line overrides
(`optimizer.learning_rate=1e-4`, values parsed as YAML scalars) and returns one `RunConfig` per
stage: a recipe either is one run, or holds `stages:` (a list of partial recipes merged over the
shared top-level keys, run in order, each starting from the previous stage's final checkpoint).

Every user mistake becomes a `UserError` whose message names the key path and, for a typo, the
closest valid key. The CLI turns it into exit status 2.
"""

from __future__ import annotations

import copy
import difflib
import math
import argparse
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.errors import UserError
from posttrain.models.config import PRESETS, ModelConfig, RematPolicy
from posttrain.tools import resolve_tool, tool_schema


class Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------
class LoraConfig(Strict):
    rank: int = Field(0, ge=0, description="0 disables LoRA (full fine-tuning)")
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Regex over module paths (qwix's module_path), e.g. q_proj|v_proj.
    target_modules: str = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    int8_base: bool = False

    @property
    def scale(self) -> float | None:
        """alpha / rank, the factor of B A in the effective weight (None without LoRA)."""
        return self.alpha / self.rank if self.rank else None


class ModelSection(Strict):
    path: str | None = Field(None, description="HF safetensors dir or Orbax checkpoint to start from")
    preset: str | None = Field(None, description="named preset, e.g. qwen3_8b")
    config: ModelConfig | None = Field(None, description="explicit architecture (from scratch)")
    scan_layers: bool = True
    remat: RematPolicy = "none"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    quantization: Literal["none", "int8"] = "none"
    attention: Literal["auto", "xla", "splash"] = Field(
        "auto", description="auto: Pallas splash attention on a single TPU device for training "
        "and scoring, XLA's formulation elsewhere and in decode")
    head_chunk_tokens: int = Field(0, ge=0, description="the loss computes the logits of this "
                                   "many tokens at a time, never [tokens, vocab] whole (the "
                                   "backward recomputes each chunk); 0: as many as keep one "
                                   "chunk's f32 logits within 1 GiB")
    lora: LoraConfig = LoraConfig()

    def switches(self) -> dict:
        """The implementation switches a ModelConfig takes from the recipe. LoRA over scanned
        layers stacks each layer's adapters and int8 base (`posttrain.models.qwix_apply`); an
        adapted head needs unrolled layers (qwix makes it on a first call of the whole model).
        A head qwix wraps (int8 QAT's rule covers lm_head; a LoRA target that matches it) must
        run as a module call, so the fused head loss is off; int8 QAT fake-quantizes inside
        every projection's call, so q/k/v are not read as plain kernels either."""
        lora_head = self.lora.rank and re.fullmatch(self.lora.target_modules, "lm_head") is not None
        wrapped_head = self.quantization == "int8" or lora_head
        return {"scan_layers": self.scan_layers and not lora_head, "remat": self.remat,
                "param_dtype": self.param_dtype, "compute_dtype": self.compute_dtype,
                "head_chunk_tokens": self.head_chunk_tokens, "attention": self.attention,
                "fused_head_loss": not wrapped_head,
                "head_major_qkv": self.quantization != "int8"}

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if self.preset is not None and self.preset not in PRESETS:
            close = difflib.get_close_matches(self.preset, PRESETS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(PRESETS)})"
            raise ValueError(f"unknown preset {self.preset!r}{hint}")
        if sum(x is not None for x in (self.preset, self.config)) > 1:
            raise ValueError("give at most one of model.preset and model.config")
        return self


class GeneratedData(Strict):
    """Data the code generates (no download): arithmetic problems 'What is a + b?', or the
    calculator task's two-digit products 'What is 37 * 48?' with a calculator tool."""

    kind: Literal["arithmetic", "calculator"] = "arithmetic"
    num_train: int = Field(20000, gt=0)
    num_eval: int = Field(500, gt=0)
    max_operand: int = Field(99, gt=0)
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="share of all problems held out")
    seed: int = 0
    worked: float = Field(0.0, ge=0, le=1, description="share of rows whose answer is worked out "
                          "column by column before 'The answer is N.' (posttrain.data.generated)")
    tool_share: float = Field(0.2, ge=0, le=1, description="calculator task: share of SFT chats "
                              "that call the calculator (posttrain.data.generated.calculator_rows)")


class DataSection(Strict):
    source: str = Field("generated", description="'generated', a jsonl/parquet file, a saved "
                        "datasets dir, or a cached hub dataset name")
    eval_source: str | None = None
    split: str = Field("train", description="split of a hub / saved DatasetDict source")
    eval_split: str = "test"
    format: Literal["text", "messages", "prompt_completion", "preference"] = Field("text", description=(
        "preference: prompt / chosen / rejected columns, strings or message lists (DPO)"))
    generated: GeneratedData = GeneratedData()
    seq_len: int = Field(256, gt=1)
    pack: bool = True
    packing: Literal["first_fit", "next_fit"] = Field("first_fit", description=(
        "how examples fill a packed row: first_fit puts each in the first row with room (5% of "
        "the quickstart's pretraining rows left empty); next_fit closes a row at the first "
        "example that overflows it (16%). Both consume the data in order"))
    loss_on: Literal["assistant", "all", "last_turn"] = "assistant"
    truncation: Literal["right", "left", "drop"] = "right"
    shuffle_seed: int = 0
    skip_bad_rows: bool = False


class TokenizerSection(Strict):
    path: str | None = Field(None, description="HF tokenizer dir; default: model.path")
    train_vocab_size: int = Field(512, gt=32, description="BPE vocab when trained on the data")


class OptimizerSection(Strict):
    name: Literal["adamw"] = "adamw"
    learning_rate: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="AdamW's two moments between steps (each update computes in f32 "
        "and stores them back): bfloat16 halves the optimizer state, 2 bytes a parameter "
        "less for each moment (a 1.2B model's 9.9 GB of f32 moments become 4.9), as optax "
        "keeps them for bf16 parameters and MaxText's mu_dtype does for the first")


class TrainSection(Strict):
    steps: int = Field(100, gt=0)
    batch_size: int = Field(16, gt=0, description="sequences per optimizer step (global)")
    grad_accum: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0, description="0 disables periodic eval")
    eval_batches: int = Field(4, gt=0)
    log_every: int = Field(10, gt=0)
    seed: int = 0
    compile_effort: Literal["auto"] | float = Field(
        "auto", description="XLA's execution-time optimisation effort for every program the "
        "stage compiles (trainer and colocated engine), -1 to 1 (`jax_exec_time_optimization_"
        "effort`); auto: -1 on a TPU for a model under 50M matmul parameters (libtpu's backend "
        "passes spend ~50 s on a 3M model's update at full effort, 7 s at -1, for steps of "
        "milliseconds either way), else 0 (XLA's default)")

    @field_validator("compile_effort")
    @classmethod
    def _effort_range(cls, v):
        if v != "auto" and not -1.0 <= v <= 1.0:
            raise ValueError("train.compile_effort: auto, or a number from -1 to 1")
        return v


class CheckpointSection(Strict):
    every: int = Field(0, ge=0, description="0: only the final checkpoint")
    keep: int = Field(2, gt=0)
    async_save: bool = True
    resume: bool = True


class WatchdogSection(Strict):
    warn_after_s: float = Field(600.0, ge=0, description="report a phase of a step (rollouts, "
                                "rewards, the update, a weight sync, evaluation, a checkpoint) "
                                "that has waited this long, naming what it waits on; 0: never")
    abort_after_s: float = Field(3600.0, ge=0, description="end the run (exit 1) when one phase "
                                 "has waited this long: it cannot make progress; 0: never")


class WandbSection(Strict):
    enabled: bool = True
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "posttrain"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = []


class TrackingSection(Strict):
    console: bool = True
    wandb: WandbSection = WandbSection()


MESH_AXES = ("data", "fsdp", "tensor", "expert")


class MeshAxes(Strict):
    data: int = 1
    fsdp: int = Field(-1, description="-1: all devices left over")
    tensor: int = 1
    expert: int = 1


DEFAULT_RULES: list[tuple[str, str | list[str] | None]] = [
    ("batch", ["data", "fsdp"]),
    ("activation_length", None),
    # Megatron-style: the residual stream is replicated over `tensor` between layers. (Sharding it
    # over `tensor` as well gave wrong logits on XLA:CPU for data=2,fsdp=2,tensor=2.)
    ("activation_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("expert", "expert"),
]


class MeshSection(Strict):
    ici: MeshAxes = MeshAxes()
    dcn: MeshAxes = MeshAxes(fsdp=1)
    rules: list[tuple[str, str | list[str] | None]] = DEFAULT_RULES


class RewardFunctionSpec(Strict):
    fn: str = Field(description="built-in name, module:function, path/to/file.py:function, or an "
                    "entry point name of the group posttrain.rewards")
    name: str | None = Field(None, description="metrics label; default derived from fn")
    weight: float = 1.0
    kwargs: dict[str, Any] = {}
    adapter: Literal["none", "verl"] = Field("none", description="verl: fn is compute_score("
                                             "data_source, solution_str, ground_truth, extra_info)")

    @property
    def label(self) -> str:
        return self.name or self.fn.rsplit(":", 1)[-1].rsplit("/", 1)[-1].removesuffix(".py")


class RewardsSection(Strict):
    functions: list[RewardFunctionSpec] = []
    timeout_s: float = Field(30.0, gt=0, description="per call of one function on one batch")
    fallback: float | Literal["drop_group"] = 0.0
    fail_fast: bool = False
    num_workers: int = Field(2, gt=0)
    solved_threshold: float = Field(1.0, description="a completion with total reward >= this is solved")
    dry_run: bool = True

    @model_validator(mode="after")
    def _unique_labels(self) -> "RewardsSection":
        labels = [f.label for f in self.functions]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise ValueError(f"reward labels must be unique (set `name`): {sorted(dup)}")
        return self


class TISSection(Strict):
    level: Literal["none", "token", "sequence"] = "token"
    cap: float = Field(2.0, gt=0)


class DynamicSampling(Strict):
    enabled: bool = False
    max_attempts: int = Field(3, gt=0)


class PairsSection(Strict):
    """Pairs made from the task when a DPO stage's data is `generated` (`posttrain/pairs.py`)."""

    prompts: int = Field(1024, gt=0, description="training prompts to sample from")
    samples: int = Field(4, gt=1, description="completions per prompt, from the starting model")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(64, gt=0)
    min_margin: float = Field(0.5, ge=0, description="least reward gap between the best "
                              "(chosen) and the worst (rejected) completion of a prompt")


class DPOSection(Strict):
    """Preference optimisation (`algorithm: dpo`); the losses' math: posttrain/algorithms/dpo.py."""

    loss: Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"] = Field("sigmoid", description=(
        "sigmoid: DPO; hinge: SLiC; ipo; robust: DPO under label noise; simpo and orpo need no "
        "reference model (TRL's names)"))
    beta: float = Field(0.1, gt=0, description="the KL strength (DPO), the margin scale (hinge), "
                        "tau (IPO), lambda of the odds-ratio term (ORPO)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="the assumed label-flip rate "
                                   "(sigmoid: cDPO; robust; simpo)")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin")
    pairs: PairsSection = PairsSection()
    reference: Literal["auto", "model", "precompute", "adapters_off"] = Field("auto", description=(
        "where the reference log-probs come from: model, a frozen copy of the starting weights "
        "scoring every batch; precompute, one pass over the data before training, cached in the "
        "run directory; adapters_off, the policy itself with its LoRA adapters off (no second "
        "copy); auto: adapters_off with LoRA, else precompute (the least memory)"))

    def reference_route(self, lora: bool) -> str | None:
        """The reference actually used: None for the reference-free losses."""
        if self.loss in ("simpo", "orpo"):
            return None
        if self.reference == "auto":
            return "adapters_off" if lora else "precompute"
        return self.reference


class GRPOSection(Strict):
    group_size: int = Field(8, gt=1, description="completions per prompt (G)")
    prompts_per_step: int = Field(8, gt=0)
    max_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    logprob_semantics: Literal["sampled", "full"] = Field("sampled", description=(
        "under top_p/top_k: 'sampled' = log-probs of the truncated, renormalised distribution "
        "the engine sampled from (trainer replays the engine's kept set); 'full' = the whole "
        "softmax everywhere (gradient of the untruncated policy)"))
    stop: list[str] = []
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    loss: Literal["token_clip", "gspo", "gspo_token"] = "token_clip"
    clip_low: float | None = Field(None, description="default 0.2; GSPO: 3e-4")
    clip_high: float | None = Field(None, description="default 0.2 (DAPO: 0.28); GSPO: 4e-4")
    dual_clip: float | None = Field(None, gt=1)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                         "seq_mean_token_sum_norm"] = "token_mean"
    beta: float = Field(0.0, ge=0, description="KL coefficient; 0 skips the reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    mu: int = Field(1, gt=0, description="updates per batch")
    mini_batches: int = Field(1, gt=0)
    logp_old: Literal["trainer", "rollout"] = Field("trainer", description=(
        "pi_old, what the ratio measures the update's move from: 'trainer' = the trainer scores "
        "the batch once before its updates (a forward over every row; folded into the update's "
        "own forward when mu = 1 and mini_batches = 1); 'rollout' = the log-probs the engine "
        "returned with the samples (no scoring pass; verl's bypass mode: the ratio is against "
        "the policy that actually sampled, so TIS has nothing left to correct). The "
        "trainer/engine agreement (`mismatch/*`) is then read off the first mini-batch's "
        "forward, before any update"))
    pack: bool = Field(True, description=(
        "pack several completions to a training row (segment ids keep attention within each) "
        "when that costs fewer token positions than padding every row to the longest"))
    shapes: Literal["auto", "ladder", "fixed"] = Field("auto", description=(
        "the update's batch shapes: ladder = rows padded to the longest on the shape ladder "
        "(`data.packing.bucket_up`), packed when cheaper, prompts shared per group (least "
        "padding, a few shapes, each compiled once); fixed = every row padded to data.seq_len, "
        "one per completion (one shape, one compile); auto = fixed on TPUs, where even the "
        "quickstart's 3M-parameter update compiles in ~50 s (each ladder shape again), ladder "
        "elsewhere"))
    tis: TISSection = TISSection()
    dynamic_sampling: DynamicSampling = DynamicSampling()
    chat_template: bool = True

    @property
    def scores_old(self) -> bool:
        """Whether the trainer scores pi_old in a pass of its own before the batch's updates
        (`logp_old`: not with the engine's log-probs, nor with one update per batch)."""
        return self.logp_old == "trainer" and not (self.mu == 1 and self.mini_batches == 1)

    def fixed_shapes(self, platform: str) -> bool:
        """Whether the update runs one fixed batch shape on `platform` (`shapes`)."""
        return self.shapes == "fixed" or (self.shapes == "auto" and platform == "tpu")

    @property
    def clip(self) -> tuple[float, float]:
        lo, hi = (3e-4, 4e-4) if self.loss.startswith("gspo") else (0.2, 0.2)
        return (self.clip_low if self.clip_low is not None else lo,
                self.clip_high if self.clip_high is not None else hi)


GPU_SHARE = 0.95  # of a GPU's memory, JAX's pool and vLLM's together; the rest: CUDA contexts,
# vLLM's torch allocations outside its budget, the weight-sync staging buffers


class RolloutSection(Strict):
    engine: Literal["jax", "vllm"] = "jax"
    placement: Literal["colocated", "disaggregated"] = "colocated"
    num_workers: int = Field(2, gt=0, description="engines (disaggregated)")
    gpu_memory_utilization: float = Field(0.15, gt=0, le=1)
    tensor_parallel_size: int = Field(1, gt=0)
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    enforce_eager: bool = Field(False, description="vLLM: skip graph capture / compilation "
                                "(faster start, ~10x slower decode on CPU)")
    enable_expert_parallel: bool = Field(False, description="vLLM: experts of MoE models over "
                                         "the tensor-parallel ranks instead of sliced")
    probe: bool = Field(True, description="after every weight sync each engine scores a fixed "
                        "probe teacher-forced and samples from its prefixes through its own "
                        "prefill + cached decode; a log-prob gap to the trainer's scores beyond "
                        "the engine's tolerance stops the run (stale or wrong weights, a fault "
                        "in the sampling path)")
    transport: Literal["auto", "in_process", "object_store", "collective", "vllm_ipc",
                       "vllm_nccl"] = Field(
        "auto", description="how weights reach the engines: in_process (colocated, the engine's "
        "model in the trainer's process), object_store (Ray workers: bucket by bucket through "
        "Ray's object store, pipelined), collective (Ray workers: gloo broadcast from the "
        "trainer), vllm_ipc (vLLM colocated on the trainer's GPUs in processes of its own, any "
        "tensor-parallel size: CUDA IPC through vLLM's IPC engine), vllm_nccl (vLLM on other "
        "GPUs or nodes: vLLM's NCCL engine); auto: vllm_ipc for colocated vLLM on GPUs, "
        "in_process for other colocated engines, vllm_nccl for vLLM workers on GPUs, "
        "object_store otherwise")
    sleep_level: int = Field(0, ge=0, le=2, description="colocated vLLM on GPUs: free its memory "
                             "during the trainer's update (1: weights to host memory, KV cache "
                             "dropped; 2: both dropped, the sync rewrites them); every wake is "
                             "followed by a sync and the probe check. Helps only a trainer whose "
                             "allocator can take the memory (XLA_PYTHON_CLIENT_ALLOCATOR=platform "
                             "or PREALLOCATE=false); JAX's default pool is fixed at start")
    gpus_per_worker: float | None = Field(None, ge=0, description="disaggregated vLLM on GPUs: "
                                          "Ray GPUs per worker (default tensor_parallel_size "
                                          "when the trainer is on GPUs)")
    bucket_mb: int = Field(256, gt=0, description="weight sync bucket size (MiB): the trainer "
                           "holds at most about two buckets of exported weights at a time")
    request_timeout_s: float = Field(3600.0, gt=0, description="disaggregated: a worker that "
                                     "has not answered its share of a batch after this long is "
                                     "hung; it is replaced and its prompts sent again")
    sync_timeout_s: float = Field(600.0, gt=0, description="collective transport: how long a "
                                  "rank waits for the others before the sync fails")
    decode_phases: int = Field(4, ge=1, le=16, description="JAX engine: the decode runs in up "
                               "to this many phases over a KV cache grown between them, each "
                               "attending only to the slots it can have filled (1.15-1.2x "
                               "faster decode on CPU). At the last boundary the grown cache and "
                               "the one before it coexist (`posttrain plan` counts both); 1: one "
                               "full-size cache throughout")
    unroll_layers: bool = Field(True, description="JAX engine: a model trained with scanned "
                                "layers decodes as its unrolled twin (weights unstacked on each "
                                "sync), whose layers read their KV buffers in place: 1.5x the "
                                "decode steps of the scan on a TPU v5e (0.6B shape, batch 64), "
                                "for a longer first compile (86 s against 16 s for a v5e at the "
                                "0.6B GRPO recipe's shape). False with model.attention: pallas: "
                                "the scan's decode kernel reads each layer of the stacked cache "
                                "in place (no slice copied per layer), 2.1x slower per step on "
                                "a v5e than the unrolled XLA decode (11.7 against 5.5 ms at 64 x "
                                "(128 + 128)) for a 4x faster compile")
    reuse_programs: bool | None = Field(None, description="JAX engine: a request whose shapes "
                                        "have no compiled decode program runs in the smallest "
                                        "compiled one that holds it (more rows, samples, "
                                        "prompt or generation slots; its extra rows discarded) "
                                        "instead of compiling its own: the weight-sync probe and "
                                        "a last partial batch ride the rollout's program. None: "
                                        "on accelerators (a decode program of a 0.6B model "
                                        "compiles for 30-100 s on a v5e), not on CPU (compiles "
                                        "are cheap, extra rows are not)")
    max_rows: int = Field(0, ge=0, description="JAX engine: at most this many sampled "
                          "sequences (prompts x group_size) per decode program, the rest in "
                          "further calls of the same program: the KV cache is this many rows' "
                          "(`posttrain plan` counts it); 0: all of a step's at once")
    continuous_batching: bool = Field(
        False, description="JAX engine, with max_rows: a step's rows decode over one cache of "
        "max_rows rows whose finished rows are refilled with the next prompts' samples (one "
        "prefill per prompt's group), instead of calls one after another, each as long as its "
        "longest row. Pays when completion lengths are uneven (`python -m "
        "benchmarks.continuous_batching`); each step then attends over prompt + max_tokens "
        "slots, where the calls' phased decode reads only the slots filled so far")
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto", description="JAX engine: the KV cache in the compute dtype (auto), or in int8 "
        "with a scale per token and KV head: half a bf16 cache's memory and bytes read per "
        "decode step (256 x (128 + 512) tokens of a 0.6B model need 18.8 GB in bf16, 9.7 in "
        "int8); log-probs move by ~5e-3 (the probe's bound is then bf16's)")

    @model_validator(mode="after")
    def _continuous_batching_needs_rows(self):
        if self.continuous_batching and (self.engine != "jax" or not self.max_rows):
            raise ValueError("continuous_batching refills the JAX engine's rows: it needs "
                             f"engine: jax and max_rows > 0 (engine {self.engine!r}, max_rows "
                             f"{self.max_rows}; vLLM batches continuously on its own)")
        return self

    @model_validator(mode="after")
    def _transport_reaches_engines(self):
        remote = self.placement == "disaggregated"
        if self.transport.startswith("vllm_"):
            if self.engine != "vllm":
                raise ValueError(f"transport {self.transport!r} is vLLM's weight-transfer engine; "
                                 f"engine is {self.engine!r}")
            if remote != (self.transport == "vllm_nccl"):
                reaches = ("vLLM on the trainer's own GPUs (colocated)" if self.transport ==
                           "vllm_ipc" else "vLLM on other GPUs or nodes (disaggregated)")
                raise ValueError(f"transport {self.transport!r} reaches {reaches}, not placement "
                                 f"{self.placement!r}; use {'vllm_nccl' if remote else 'vllm_ipc'}")
            return self._check_sleep()
        if self.engine == "vllm" and not remote and self.tensor_parallel_size > 1 and \
                self.transport == "in_process":
            raise ValueError("transport 'in_process' cannot reach a colocated vLLM engine with "
                             f"tensor_parallel_size {self.tensor_parallel_size}: its tensor-"
                             "parallel ranks are processes of their own; use vllm_ipc (or auto)")
        if self.transport != "auto" and remote == (self.transport == "in_process"):
            raise ValueError(f"transport {self.transport!r} cannot reach "
                             f"{'Ray workers' if remote else 'colocated engines'} "
                             f"(placement {self.placement!r}); use auto")
        return self._check_sleep()

    @model_validator(mode="after")
    def _kv_int8_is_jax(self):
        if self.kv_cache_dtype == "int8" and self.engine != "jax":
            raise ValueError("rollout.kv_cache_dtype int8 is the JAX engine's; vLLM sizes and "
                             "types its own cache (engine: jax, or kv_cache_dtype: auto)")
        return self

    def _check_sleep(self):
        if self.sleep_level:
            if self.engine != "vllm" or self.placement != "colocated":
                raise ValueError("sleep_level: only a colocated vLLM engine sleeps during the "
                                 f"update (engine {self.engine!r}, placement {self.placement!r})")
            if not self.probe:
                raise ValueError("sleep_level needs probe: true (an engine that woke with "
                                 "weights other than the trainer's must be caught)")
        return self

    def weight_transfer(self, platform: str) -> str | None:
        """vLLM's weight-transfer backend the engine is built with ("ipc" / "nccl"), given the
        trainer's platform ("gpu", "cpu", "tpu"); None: weights reach it another way."""
        if self.engine != "vllm":
            return None
        if self.transport.startswith("vllm_"):
            return self.transport.removeprefix("vllm_")
        if self.transport == "auto" and platform == "gpu":
            return "ipc" if self.placement == "colocated" else "nccl"
        if self.transport == "auto" and self.placement == "colocated" and self.tensor_parallel_size > 1:
            return "ipc"
        return None


class ToolSpecSection(Strict):
    fn: str = Field(description="built-in (calculator, python), module:function or "
                    "path/to/file.py:function: type hints and docstring become its JSON schema")
    name: str | None = Field(None, description="the name the model calls it by (default: fn's)")
    kwargs: dict[str, Any] = Field({}, description="bound arguments the model does not see")


class AgentSection(Strict):
    """Multi-turn episodes (rollout.episodes): on when `tools` or `environment` is set."""

    tools: list[ToolSpecSection] = []
    environment: str | None = Field(None, description="module:Class or path/to/file.py:Class, "
                                    "a rollout.episodes.Environment (instead of the tools one)")
    environment_kwargs: dict[str, Any] = {}
    parser: Literal["hermes"] = Field("hermes", description="the model's tool-call syntax")
    max_turns: int = Field(4, gt=0, description="model turns per episode")
    max_tokens: int = Field(256, gt=0, description="completion tokens per episode, model and "
                            "environment together (each turn at most grpo.max_tokens)")
    tool_timeout_s: float = Field(10.0, gt=0, description="per tool call")
    tool_workers: int = Field(2, gt=0, description="tool worker processes")
    max_calls_per_turn: int = Field(4, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None


class EvalSection(Strict):
    every: int = Field(0, ge=0, description="held-out evaluation every N steps (0: only at the end)")
    num_problems: int = Field(200, gt=0)
    reward: str | None = Field(None, description="reward label that defines 'correct' (default: first)")
    max_tokens: int | None = None
    after_stage: bool = Field(False, description="held-out accuracy after the stage; a summary "
                              "table and plot for the recipe")


class PlanSection(Strict):
    accelerator: Literal["h100", "h200", "a100", "b200", "mi300x", "v4", "v5e", "v5p", "v6e",
                         "cpu"] = Field("h100", description="device `posttrain plan` fits to")


class AsyncSection(Strict):
    off_policy_steps: int = Field(0, ge=0, le=1, description=(
        "1: generate batch k+1 (with the weights of step k) while training on batch k; the "
        "staleness is corrected by importance sampling (grpo.tis)"))


class RayConfig(Strict):
    address: str | None = Field(None, description="join this cluster; default: start a local Ray")


class TrainerSection(Strict):
    hosts: int = Field(1, gt=0, description="trainer processes, one Ray actor per host, running "
                       "one JAX program over a mesh of all their devices; 1: the trainer runs "
                       "in the driver's process")
    devices_per_host: int | None = Field(None, gt=0, description="devices each host contributes "
                                         "(CPU: how many XLA exposes; GPU/TPU: default all)")
    platform: Literal["auto", "cpu", "gpu", "tpu"] = Field(
        "auto", description="auto: gpu with gpus_per_host, tpu with a TPU resource, else cpu")
    cpus_per_host: float = Field(1.0, ge=0, description="Ray CPUs reserved per trainer actor")
    gpus_per_host: float = Field(0.0, ge=0, description="Ray GPUs reserved per trainer actor")
    resources: dict[str, float] = Field({}, description="other Ray resources per actor, e.g. "
                                        "{TPU: 4} on a TPU VM")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="Ray placement group strategy for the trainer actors "
        "(STRICT_SPREAD: one per node)")
    init_timeout_s: float = Field(300.0, gt=0, description="how long the group waits for its "
                                  "actors to be placed and every host to join jax.distributed")
    memory_fraction: float | None = Field(None, gt=0, lt=1, description="GPUs: the share of each "
                                          "GPU's memory JAX preallocates for the trainer "
                                          "(XLA_PYTHON_CLIENT_MEM_FRACTION); default: JAX's 0.75, "
                                          "or beside a colocated vLLM engine 0.95 minus its "
                                          "rollout.gpu_memory_utilization")

    @property
    def resolved_platform(self) -> str:
        if self.platform != "auto":
            return self.platform
        return "gpu" if self.gpus_per_host else "tpu" if "TPU" in self.resources else "cpu"


class RunConfig(Strict):
    name: str = "run"
    algorithm: Literal["pretrain", "sft", "grpo", "dpo"] = "pretrain"
    run_dir: str = "runs/run"
    seed: int = 0
    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    watchdog: WatchdogSection = WatchdogSection()
    tracking: TrackingSection = TrackingSection()
    mesh: MeshSection = MeshSection()
    rewards: RewardsSection = RewardsSection()
    grpo: GRPOSection = GRPOSection()
    dpo: DPOSection = DPOSection()
    rollout: RolloutSection = RolloutSection()
    async_: AsyncSection = Field(AsyncSection(), alias="async")  # `async` is a Python keyword
    eval: EvalSection = EvalSection()
    agent: AgentSection = AgentSection()
    ray: RayConfig = RayConfig()
    trainer: TrainerSection = TrainerSection()
    plan: PlanSection = PlanSection()

    @property
    def head_window(self) -> int:
        """Positions of a GRPO row the LM head needs (`build_batch`'s `head_index`): the span a
        completion's loss can cover (grpo.max_tokens; a multi-turn episode's agent.max_tokens,
        model and tool tokens together), rounded up to 8 (a sublane tile); 0 when that is the
        whole row."""
        span = self.agent.max_tokens if self.agent.enabled else self.grpo.max_tokens
        w = -(-span // 8) * 8
        return w if w < self.data.seq_len else 0

    @model_validator(mode="after")
    def _group_reaches_engines(self) -> "RunConfig":
        if self.trainer.hosts > 1 and self.algorithm == "grpo":
            r = self.rollout
            if r.placement == "colocated":
                raise ValueError("trainer.hosts > 1 needs rollout.placement: disaggregated (a "
                                 "colocated engine lives in the trainer's process; a trainer "
                                 "group has no single one)")
            if r.transport not in ("auto", "object_store"):
                raise ValueError(f"rollout.transport {r.transport!r}: a trainer group sends "
                                 "weights through the object store (auto or object_store)")
        return self

    @model_validator(mode="after")
    def _memory_split(self) -> "RunConfig":
        r = self.rollout
        if r.sleep_level and self.async_.off_policy_steps:
            raise ValueError("rollout.sleep_level: the engine generates the next batch during "
                             "the update when async.off_policy_steps is 1; it cannot sleep then")
        if self.algorithm != "grpo" or r.engine != "vllm" or r.placement != "colocated":
            return self
        total = self.memory_fraction() + r.gpu_memory_utilization
        if total > GPU_SHARE + 1e-9:
            raise ValueError(
                f"trainer.memory_fraction ({self.memory_fraction():g}) + "
                f"rollout.gpu_memory_utilization ({r.gpu_memory_utilization:g}) = {total:.2f} of "
                f"each GPU: more than {GPU_SHARE} (the rest holds both processes' CUDA contexts "
                "and the weight-sync staging buffers); lower one of them")
        return self

    def memory_fraction(self) -> float:
        """The share of each GPU JAX preallocates for the trainer (see trainer.memory_fraction)."""
        if self.trainer.memory_fraction is not None:
            return self.trainer.memory_fraction
        r = self.rollout
        if self.algorithm == "grpo" and r.engine == "vllm" and r.placement == "colocated":
            return round(GPU_SHARE - r.gpu_memory_utilization, 4)
        return 0.75

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# loading: YAML + overrides -> validated configs, with errors that name the key
# ----------------------------------------------------------------------------------------------
def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as a YAML scalar)."""
    if "=" not in item:
        raise UserError(f"override {item!r}: expected key.sub=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise UserError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return key.split("."), value


def set_dotted(tree: dict, path: list[str], value: Any) -> None:
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[_list_index(node, part, path[: i + 1])]
            continue
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict | list):
            raise UserError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
    last = path[-1]
    if isinstance(node, list):
        node[_list_index(node, last, path)] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override {'.'.join(path)}: {part!r} is not an index of a {len(node)}-item list")
    return int(part)


def deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _valid_keys(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at `loc` (the parent of an unknown key) in the schema."""
    cls: Any = model_cls
    for part in loc:
        if isinstance(part, int):
            continue
        fields = ({f.alias or n: f for n, f in cls.model_fields.items()}
                  if isinstance(cls, type) and issubclass(cls, BaseModel) else {})
        field = fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        # unwrap Optional[X] / X | None
        for arg in getattr(ann, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                ann = arg
        cls = ann
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return [f.alias or n for n, f in cls.model_fields.items()]
    return []


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        path = prefix + ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent, key = loc[:-1], str(loc[-1])
            close = difflib.get_close_matches(key, _valid_keys(RunConfig, parent), n=1, cutoff=0.6)
            where = ".".join([prefix.rstrip(".")] * bool(prefix) + [str(p) for p in parent])
            hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
            lines.append(f"{path}: unknown key{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
            lines.append(f"{path or '<recipe>'}: {msg}{shown}")
    return "; ".join(lines)


def validate_tree(tree: dict, prefix: str = "") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise UserError(format_validation_error(e, prefix)) from None


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: recipe file not found")
    try:
        tree = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}:{where}: malformed YAML: {problem}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a recipe must be a mapping of keys, got {type(tree).__name__}")
    return tree


def load_recipe(path: str | os.PathLike, overrides: list[str] = ()) -> list[RunConfig]:
    """Read a recipe, apply overrides, and return the validated config of every stage."""
    tree = read_yaml(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(tree, key, value)
    return resolve_stages(tree)


def add_recipe_arguments(p: argparse.ArgumentParser, many: bool = False) -> None:
    """RECIPE then overrides, the same in run, validate and plan: `key.sub=value` positionally
    or `--set key.sub=value` (repeatable); both may be mixed."""
    p.add_argument("items", nargs="+", metavar="RECIPE" + (" [RECIPE ...]" if many else "")
                   + " [key.sub=value ...]", help="recipe file(s), then overrides")
    p.add_argument("--set", dest="set_overrides", action="append", default=[],
                   metavar="key.sub=value", help="an override (same as a positional key=value)")
    p.set_defaults(many_recipes=many)


def recipes_and_overrides(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Split the positional items into recipe files and `key=value` overrides."""
    recipes = [a for a in args.items if "=" not in a or Path(a).is_file()]
    overrides = [a for a in args.items if a not in recipes] + args.set_overrides
    if not recipes:
        raise UserError("no recipe given (positional items with '=' are overrides)")
    if len(recipes) > 1 and not args.many_recipes:
        raise UserError(f"one recipe expected, got {len(recipes)}: {' '.join(recipes)} "
                        "(overrides are key.sub=value)")
    return recipes, overrides


def resolve_stages(tree: dict) -> list[RunConfig]:
    stages = tree.pop("stages", None)
    base = validate_tree(tree)
    if stages is None:
        return [base]
    if not isinstance(stages, list) or not stages:
        raise UserError("stages: must be a non-empty list of partial recipes")
    out = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            raise UserError(f"stages.{i}: must be a mapping of keys")
        if "stages" in stage:
            raise UserError(f"stages.{i}.stages: stages cannot nest")
        merged = deep_merge(tree, stage)
        merged.setdefault("name", f"stage{i}")
        merged["run_dir"] = str(Path(base.run_dir) / merged["name"]) if "run_dir" not in stage else stage["run_dir"]
        try:
            out.append(RunConfig.model_validate(merged))
        except ValidationError as e:
            raise UserError(format_validation_error(e, prefix=f"stages.{i}.")) from None
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise UserError(f"stages: stage names must be unique, got {names}")
    return out


# ----------------------------------------------------------------------------------------------
# cross-checks that need more than one key (posttrain validate; also run before every run)
# ----------------------------------------------------------------------------------------------
def mesh_shape(mesh: MeshSection, num_devices: int) -> dict[str, int]:
    """Resolve -1 in `mesh.ici` and check that ici x dcn covers exactly `num_devices`."""
    ici = mesh.ici.model_dump()
    dcn = mesh.dcn.model_dump()
    for name, axes in (("mesh.ici", ici), ("mesh.dcn", dcn)):
        for ax, n in axes.items():
            if n == 0 or n < -1:
                raise UserError(f"{name}.{ax}: must be a positive size or -1 (got {n})")
    if any(n == -1 for n in dcn.values()):
        raise UserError("mesh.dcn: -1 is only allowed in mesh.ici")
    hosts = 1
    for n in dcn.values():
        hosts *= n
    if num_devices % hosts:
        raise UserError(f"mesh.dcn: product {hosts} does not divide the {num_devices} devices")
    per_host = num_devices // hosts
    fill = [ax for ax, n in ici.items() if n == -1]
    if len(fill) > 1:
        raise UserError(f"mesh.ici: at most one axis may be -1 (got {', '.join(fill)})")
    known = 1
    for n in ici.values():
        known *= n if n != -1 else 1
    if fill:
        if per_host % known:
            raise UserError(f"mesh.ici: fixed axes (product {known}) do not divide the "
                            f"{per_host} devices per host")
        ici[fill[0]] = per_host // known
    elif known != per_host:
        raise UserError(f"mesh.ici: product {known} x dcn {hosts} = {known * hosts} does not "
                        f"match the {num_devices} devices")
    return {ax: ici[ax] * dcn[ax] for ax in MESH_AXES}


def cross_check(cfg: RunConfig, num_devices: int, *, produced_by_earlier_stage: bool = False,
                prefix: str = "") -> dict[str, int]:
    """Checks that span keys. Returns the resolved mesh shape."""
    shape = mesh_shape(cfg.mesh, num_devices)
    t = cfg.train
    batch_shards = shape["data"] * shape["fsdp"]
    if cfg.algorithm == "grpo":  # a GRPO batch is prompts x group, split into mini-batches
        rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size
        micro = rows // cfg.grpo.mini_batches // t.grad_accum
        if micro * cfg.grpo.mini_batches * t.grad_accum != rows or micro % batch_shards:
            raise UserError(f"{prefix}grpo.prompts_per_step: {rows} completions per step must split "
                            f"into grpo.mini_batches ({cfg.grpo.mini_batches}) x train.grad_accum "
                            f"({t.grad_accum}) micro-batches divisible by the data x fsdp mesh size "
                            f"({batch_shards})")
    else:
        if t.batch_size % t.grad_accum:
            raise UserError(f"{prefix}train.batch_size: {t.batch_size} is not divisible by "
                            f"train.grad_accum ({t.grad_accum})")
        micro = t.batch_size // t.grad_accum
        if micro % batch_shards:
            raise UserError(f"{prefix}train.batch_size: the micro-batch ({micro} = batch_size / "
                            f"grad_accum) is not divisible by the data x fsdp mesh size ({batch_shards})")
    for key, value in (("data.source", cfg.data.source), ("data.eval_source", cfg.data.eval_source),
                       ("tokenizer.path", cfg.tokenizer.path)):
        if value and value != "generated" and _looks_like_path(value) and not Path(value).exists():
            raise UserError(f"{prefix}{key}: {value}: no such file or directory")
    if cfg.model.path and not produced_by_earlier_stage and _looks_like_path(cfg.model.path) \
            and not Path(cfg.model.path).exists():
        raise UserError(f"{prefix}model.path: {cfg.model.path}: no such file or directory")
    if cfg.algorithm == "pretrain" and cfg.data.format != "text":
        raise UserError(f"{prefix}data.format: pretrain trains on plain text (got {cfg.data.format})")
    if cfg.algorithm == "grpo" and cfg.model.path is None and not produced_by_earlier_stage:
        raise UserError(f"{prefix}model.path: grpo starts from a checkpoint; set model.path")
    if cfg.algorithm == "grpo":
        g = cfg.grpo
        if not cfg.rewards.functions:
            raise UserError(f"{prefix}rewards.functions: grpo needs at least one reward function")
        if g.max_tokens >= cfg.data.seq_len:
            raise UserError(f"{prefix}data.seq_len: {cfg.data.seq_len} must exceed grpo.max_tokens "
                            f"({g.max_tokens}) plus the prompt")
    if cfg.algorithm == "grpo":
        check_rollout_devices(cfg, num_devices, prefix)
    if (cfg.algorithm == "dpo") != (cfg.data.format == "preference"):
        raise UserError(f"{prefix}data.format: {cfg.data.format!r} with algorithm {cfg.algorithm!r} "
                        "(dpo trains on preference pairs, and only dpo does)")
    if cfg.algorithm == "dpo" and cfg.dpo.reference == "adapters_off" and not cfg.model.lora.rank:
        raise UserError(f"{prefix}dpo.reference: adapters_off needs LoRA (model.lora.rank > 0)")
    if cfg.algorithm == "dpo" and cfg.data.source == "generated":  # pairs sampled from the model
        if cfg.model.path is None and not produced_by_earlier_stage:
            raise UserError(f"{prefix}model.path: dpo on generated data samples its pairs from "
                            "a model; set model.path")
        if not cfg.rewards.functions:
            raise UserError(f"{prefix}rewards.functions: dpo on generated data ranks the sampled "
                            "completions with the rewards; set at least one")
    check_agent(cfg.agent, prefix)
    if cfg.model.lora.rank and cfg.model.quantization == "int8":
        raise UserError(f"{prefix}model.quantization: int8 QAT and LoRA do not combine; for a "
                        "frozen int8 base use model.lora.int8_base: true")
    return shape


def check_agent(a: AgentSection, prefix: str = "") -> None:
    """Every tool resolves and has a JSON schema (type hints and docstring), now rather than at
    the first rollout; one environment source."""
    if a.environment is not None and a.tools:
        raise UserError(f"{prefix}agent: set tools or environment, not both (an environment "
                        "offers its own tools through its `tools` attribute)")
    if a.environment is not None and ":" not in a.environment:
        raise UserError(f"{prefix}agent.environment: {a.environment!r} is not module:Class or "
                        "path/to/file.py:Class")
    for j, t in enumerate(a.tools):
        try:
            tool_schema(resolve_tool(t.fn), t.fn, tuple(t.kwargs))
        except UserError as e:
            raise UserError(f"{prefix}agent.tools.{j}.fn: {e}") from None


FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".txt", ".safetensors",
                 ".yaml", ".yml", ".gz", ".zst")


def _looks_like_path(value: str) -> bool:
    """Hub ids (org/name, dots allowed: Qwen/Qwen3-0.6B) are not local paths; anything with a
    ./ or / prefix, other than one slash, or a data or weights file's suffix is."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") != 1 or \
        value.lower().endswith(FILE_SUFFIXES)


def apply_memory_split(stages: list[RunConfig]) -> None:
    """Before JAX starts: the share of each GPU it preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION),
    the smallest any stage asks for (one JAX process runs them all). A recipe's
    trainer.memory_fraction wins over the environment; the default beside a colocated vLLM
    engine (0.95 minus its share) applies only where the environment sets nothing."""
    import os

    explicit = [c.trainer.memory_fraction for c in stages if c.trainer.memory_fraction is not None]
    if explicit:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(explicit):g}"
        return
    shared = [c.memory_fraction() for c in stages if c.algorithm == "grpo"
              and c.rollout.engine == "vllm" and c.rollout.placement == "colocated"]
    if shared:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{min(shared):g}")


GPU_KINDS = ("h100", "h200", "a100", "b200", "mi300x")


def check_rollout_devices(cfg: RunConfig, num_devices: int, prefix: str = "") -> None:
    """The rollout engine against the devices: placement, tensor parallel size, transport and
    the device kind (`plan.accelerator`) must go together."""
    r, kind = cfg.rollout, cfg.plan.accelerator
    if r.engine != "vllm":
        return
    gpu = kind in GPU_KINDS
    if r.transport.startswith("vllm_") and not gpu:
        raise UserError(f"{prefix}rollout.transport: {r.transport} moves weights between GPUs "
                        f"(CUDA IPC / NCCL); plan.accelerator is {kind!r}")
    if not gpu and kind != "cpu" and r.placement == "colocated":  # a TPU
        raise UserError(f"{prefix}rollout.engine: vllm colocated with a JAX trainer on TPU "
                        f"({kind}) is not supported (vLLM's TPU backend holds the chips "
                        "itself); use engine: jax, or placement: disaggregated on devices of "
                        "its own")
    if r.placement == "colocated" and r.tensor_parallel_size > num_devices:
        raise UserError(f"{prefix}rollout.tensor_parallel_size: {r.tensor_parallel_size} ranks "
                        f"of a colocated vLLM engine need as many of the trainer's devices; "
                        f"the mesh has {num_devices}")


def named_devices(cfg: RunConfig) -> int | None:
    """The device count a stage names: its mesh's when no axis is -1, a trainer group's
    hosts x devices_per_host; None when a -1 axis takes whatever there is."""
    ici, dcn, t = cfg.mesh.ici.model_dump(), cfg.mesh.dcn.model_dump(), cfg.trainer
    if any(v == -1 for v in ici.values()):
        return t.hosts * t.devices_per_host if t.hosts > 1 and t.devices_per_host else None
    return math.prod(ici.values()) * math.prod(dcn.values())


def validation_devices(stages: list[RunConfig], local: int) -> tuple[int, str | None]:
    """The device count `posttrain validate` checks a recipe against: the one its mesh names
    when this machine has a different count (a GPU/TPU recipe validated on a laptop), else
    this machine's. The reason comes back when it is not this machine's count."""
    named = next((n for n in map(named_devices, reversed(stages)) if n is not None), None)
    if named is None or named == local:
        return local, None
    return named, f"the count the recipe's mesh names; this machine has {local}"


def trainer_devices(cfg: RunConfig, local: int) -> int:
    """The devices the trainer's mesh covers: this process's (`local`), or a trainer group's
    hosts x devices_per_host (each host's own count when devices_per_host is unset)."""
    t = cfg.trainer
    return local if t.hosts == 1 else t.hosts * (t.devices_per_host or local)


def check_recipe(stages: list[RunConfig], num_devices: int) -> None:
    """`num_devices`: this machine's; a stage with a trainer group checks against its hosts'."""
    for i, cfg in enumerate(stages):
        prefix = f"stages.{i}." if len(stages) > 1 else ""
        cross_check(cfg, trainer_devices(cfg, num_devices), produced_by_earlier_stage=i > 0,
                    prefix=prefix)
        t, dcn = cfg.trainer, math.prod(cfg.mesh.dcn.model_dump().values())
        if t.hosts % dcn:
            raise UserError(f"{prefix}mesh.dcn: its product ({dcn}) must divide trainer.hosts "
                            f"({t.hosts}): dcn axes span hosts")
