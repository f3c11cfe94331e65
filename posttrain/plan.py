"""`posttrain plan`: the per-device memory and sharding plan of a recipe, before any hardware.

Two independent answers, side by side:

1. An analytical estimate per device: parameters, gradients, optimizer state, the frozen
   reference (GRPO with beta > 0), activations saved for the backward pass under the recipe's
   remat policy, the logits, and the rollout engine's weights and KV cache. Every parameter's
   per-device block comes from the same logical-axis rules the trainer uses (on an abstract mesh:
   nothing is allocated), so an axis that does not divide shows up here as it would in a run.
2. XLA's own numbers: the real train step (same loss, optimizer, shardings, donation) lowered
   and compiled ahead of time for the target, as MaxText's train_compile does. TPU targets
   (`--topology v5p-64`) compile through libtpu's topology description on this CPU machine
   (libtpu installed aside, see LIBTPU); GPU targets lower and compile on a CPU mesh of the
   same shape, which proves every sharding divides (XLA:CPU's buffer sizes, not CUDA kernels').

It then says whether the plan fits the accelerator, and if not, which setting to change and to
what value.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field

from posttrain.config import GPU_KINDS, GPU_SHARE, add_recipe_arguments, recipes_and_overrides
from posttrain.errors import UserError

GB = 1e9
GIB = 2 ** 30  # TPU HBM comes in binary gigabytes
# name -> (label, bytes of device memory)
ACCELERATORS = {
    "h100": ("NVIDIA H100 80GB", 80 * GB), "h200": ("NVIDIA H200 141GB", 141 * GB),
    "a100": ("NVIDIA A100 80GB", 80 * GB), "b200": ("NVIDIA B200 180GB", 180 * GB),
    "mi300x": ("AMD MI300X 192GB", 192 * GB), "v4": ("TPU v4 32GiB", 32 * GIB),
    "v5e": ("TPU v5e 16GiB", 16 * GIB), "v5p": ("TPU v5p 95GiB", 95 * GIB),
    "v6e": ("TPU v6e 32GiB", 32 * GIB), "cpu": ("host CPU", 24 * GB),
}
# TPU slice names (TensorCores for v4/v5p, chips for v5e/v6e) -> libtpu topology, chips
TPU_TOPOLOGIES = {
    "v4-8": "v4:2x2x1", "v4-16": "v4:2x2x2", "v4-32": "v4:2x2x4", "v4-64": "v4:2x4x4",
    "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
    "v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8",
    "v5e-1": "v5e:1x1", "v6e-1": "v6e:1x1",
    "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4", "v5e-256": "v5e:16x16",
    "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-256": "v6e:16x16",
}
CUDA_CONTEXT = 0.6 * GB  # per process and GPU: CUDA context + cuBLAS/NCCL workspaces (typical
# of CUDA 12; not measured on these machines)
USABLE = 0.92  # of a GPU's memory: the runtime, XLA's scratch and fragmentation take the rest
# of a TPU's HBM: what its runtime lets XLA allocate (a v5e: 15.75 of 16 GiB, in XLA's
# out-of-memory reports and the chip's bytes limit; the other TPUs taken to be alike)
USABLE_TPU = 15.75 / 16
def usable(accelerator: str) -> float:
    """The fraction of `accelerator`'s memory a plan may fill."""
    return USABLE_TPU if ACCELERATORS[accelerator][0].startswith("TPU") else USABLE


def program_bytes(m) -> int:
    """A compiled program's bytes on its device from XLA's `memory_analysis()`: arguments,
    outputs not aliased to them, and temporaries."""
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
# The libtpu that jax[tpu]==0.10.2 pins. Installed *outside* site-packages (vLLM takes an
# importable libtpu to mean "this machine has TPUs" and refuses to start on CPU):
#   pip install --no-deps --target "$VIRTUAL_ENV/libtpu" libtpu==0.0.42.1   (make install does)
LIBTPU = "libtpu==0.0.42.1"


@dataclass
class Estimate:
    """Bytes per device, by component."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    reference: float = 0.0
    casts: float = 0.0
    gathered: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    batch: float = 0.0
    rollout_weights: float = 0.0
    rollout_kv: float = 0.0
    vllm_needed: float = 0.0  # vLLM weights + every sequence of a step in its KV cache at once
    staging: float = 0.0  # vllm_ipc: the trainer's torch staging buffer, outside JAX's pool
    contexts: float = 0.0  # CUDA contexts of the trainer's and vLLM's processes
    jax_share: float = 0.0  # colocated vLLM on GPUs: JAX's preallocated pool (memory_fraction)
    notes: list[str] = field(default_factory=list)

    @property
    def trainer(self) -> float:
        return (self.params + self.grads + self.optimizer + self.reference + self.casts
                + self.gathered + self.activations + self.logits + self.batch)

    @property
    def rollout(self) -> float:
        return self.rollout_weights + self.rollout_kv + self.staging + self.contexts

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters", self.params), ("gradients", self.grads),
                ("optimizer state", self.optimizer), ("reference model", self.reference),
                ("parameters cast to the compute dtype", self.casts),
                ("gathered layer weights + their gradients", self.gathered),
                ("activations (saved for backward)", self.activations),
                ("logits", self.logits), ("batch", self.batch),
                ("rollout weights", self.rollout_weights), ("rollout KV cache", self.rollout_kv),
                ("weight-sync staging (torch, outside JAX's pool)", self.staging),
                ("CUDA contexts (trainer + vLLM processes)", self.contexts)]


# ---- inputs ------------------------------------------------------------------------------------
def model_config_for_plan(cfg):
    """The architecture without downloading anything: a local model.path's config.json (or a hub
    id's, already in the local HF cache), else the preset, else model.config."""
    from pathlib import Path

    from posttrain.models.config import ModelConfig

    m = cfg.model
    switches = m.switches()
    if m.path and (Path(m.path) / "config.json").is_file():
        from posttrain.models.loading import hf_model_config

        return hf_model_config(Path(m.path), **switches)
    if m.path and m.path.count("/") == 1 and not Path(m.path).exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(m.path, "config.json")
        if isinstance(cached, str):
            from posttrain.models.loading import hf_model_config

            return hf_model_config(Path(cached).parent, **switches)
    if m.preset:
        return ModelConfig.preset(m.preset, **switches)
    if m.config is not None:
        return m.config.model_copy(update=switches)
    raise UserError("model: `posttrain plan` needs model.preset (or a local model.path with "
                    "config.json, or model.config) to know the architecture without downloading")


def rows_per_update(cfg) -> int:
    """Sequences in one optimizer update (before grad_accum splits them into micro-batches)."""
    if is_rl(cfg):
        g = cfg.grpo
        return g.prompts_per_step * g.group_size // g.mini_batches
    return cfg.train.batch_size


def is_rl(cfg) -> bool:
    return cfg.algorithm == "grpo"  # GSPO, DAPO and Dr.GRPO are GRPO settings


# ---- analytical estimate -------------------------------------------------------------------------
def activation_bytes_per_token_layer(mc, remat: str, tensor: int, seq_len: int) -> float:
    """Bytes one token leaves per layer for the backward pass, by remat policy. Head and MLP
    dimensions are split over the tensor axis; attention keeps exp(scores - max), f32 [H, T], for
    its backward (`layers._attend`: the scores themselves and the probabilities are transient)."""
    c = 2 if mc.compute_dtype == "bfloat16" else 4
    e, h, k, d = mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    hd, kd = h * d / tensor, k * d / tensor
    scores = 4 * h / tensor * seq_len  # exp(scores - max), f32
    if mc.is_moe:
        f_act = mc.num_experts_per_tok * mc.moe_intermediate_size
        mlp = 3 * f_act * c + mc.num_experts_per_tok * 2 * e * c + 3 * 4 * mc.num_experts
    else:
        mlp = 3 * mc.intermediate_size / tensor * c  # gate, up, silu(gate)*up
    norms = 2 * e * c + 2 * e * 4  # two normalised inputs (+ their f32 copies)
    attn = (2 * hd + 3 * kd + hd) * c + scores  # q, rope(q), k, v, rope(k), attention out
    everything = norms + attn + mlp + 3 * e * c  # + o_proj out, residuals
    if remat == "none":
        return everything
    if remat == "full":
        return e * c  # the layer input only (one layer is recomputed at a time: see below)
    dots = (hd + 2 * kd + hd) * c + e * c + mlp * (2 / 3) + e * c  # matmul outputs
    if remat == "dots":
        return dots + scores  # the scores product's output (a batched dot), f32
    if remat == "dots_no_batch":
        return dots
    if remat == "save_qkv_proj":  # q, k, v projections
        return e * c + (hd + 2 * kd) * c
    if remat == "save_qkvo":  # and o_proj's output
        return e * c + (hd + 2 * kd) * c + e * c
    if remat == "save_attention":  # and splash's output (bf16) and log-sum-exp (f32 per head)
        return e * c + e * c + hd * c + 4 * h / tensor
    return e * c + e * c  # save_out_proj


def estimate(cfg, mc, mesh_sizes: dict[str, int], hbm: float) -> Estimate:
    from flax import nnx
    from jax.sharding import AbstractMesh

    from posttrain.models.transformer import CausalLM
    from posttrain.sharding import param_shard_shapes

    est = Estimate()
    mesh = AbstractMesh(tuple(mesh_sizes.values()), tuple(mesh_sizes))
    abstract = nnx.eval_shape(lambda: CausalLM(mc, nnx.Rngs(0)))
    shapes = param_shard_shapes(nnx.state(abstract, nnx.Param), mesh, cfg.mesh.rules)
    pbytes = sum(math.prod(local) * dt.itemsize for _, local, dt in shapes.values())
    lora = cfg.model.lora
    if lora.rank:
        target = re.compile(lora.target_modules)
        adapters = sum((g[-2] + g[-1]) * lora.rank * 4 * (math.prod(g[:-2]) if len(g) > 2 else 1)
                       for p, (g, _, _) in shapes.items()
                       if p[-1] == "kernel" and target.search("/".join(map(str, p[:-1]))))
        base = sum(math.prod(local) * (1 if lora.int8_base and p[-1] == "kernel" else dt.itemsize)
                   for p, (_, local, dt) in shapes.items())
        est.params, trainable = base + adapters, adapters
        trainable_f32 = adapters  # the adapters are f32
        est.notes.append(f"LoRA r{lora.rank}: {adapters / GB:.3f} GB of adapters (replicated)")
    else:
        est.params, trainable = pbytes, pbytes
        trainable_f32 = sum(math.prod(local) * 4 for _, local, _ in shapes.values())
    # the gradient of the micro-batch, plus the accumulator when grad_accum > 1
    est.grads = trainable * (2 if cfg.train.grad_accum > 1 else 1)
    # AdamW's two moments, f32 whatever the parameters' dtype unless optimizer.moments_dtype
    est.optimizer = 2 * trainable_f32 // (2 if cfg.optimizer.moments_dtype == "bfloat16" else 1)
    if is_rl(cfg) and cfg.grpo.beta > 0:
        est.reference = trainable
    c = 2 if mc.compute_dtype == "bfloat16" else 4
    if mc.compute_dtype != mc.param_dtype:  # XLA hoists the casts of the stacked weights
        est.casts = sum(math.prod(local) * c for _, local, _ in shapes.values())
    # FSDP: each layer's weights are all-gathered over the batch axes (data, fsdp) in the compute
    # dtype, once for the forward, again for the recomputation/backward, with the next layer's
    # prefetched; the layer's gradient exists unreduced (f32) before its reduce-scatter.
    unsharded = AbstractMesh(tuple(1 if a in ("data", "fsdp") else n for a, n in mesh_sizes.items()),
                             tuple(mesh_sizes))
    if mesh_sizes["data"] * mesh_sizes["fsdp"] > 1:
        full = param_shard_shapes(nnx.state(abstract, nnx.Param), unsharded, cfg.mesh.rules)
        per_layer = sum(math.prod(local) / (mc.num_hidden_layers if "layers" in p else 1)
                        for p, (_, local, _) in full.items() if "layers" in p)
        est.gathered = per_layer * (3 * c + 4)
    batch_shards = mesh_sizes["data"] * mesh_sizes["fsdp"]
    rows = rows_per_update(cfg) / cfg.train.grad_accum / batch_shards
    t = cfg.data.seq_len
    tokens = rows * t
    per_layer = activation_bytes_per_token_layer(mc, mc.remat, mesh_sizes["tensor"], t)
    est.activations = tokens * per_layer * mc.num_hidden_layers
    if mc.remat != "none":  # the layer being recomputed holds its full activations
        est.activations += tokens * activation_bytes_per_token_layer(mc, "none", mesh_sizes["tensor"], t)
    vocab_local = math.ceil(mc.vocab_size / mesh_sizes["tensor"])
    # logits in the compute dtype and in f32, a chunk of positions at a time: every loss runs
    # the LM head in chunks (`posttrain.train.step.head_chunk`)
    from posttrain.train.step import head_chunk

    tokens = math.ceil(rows) * head_chunk(mc, math.ceil(rows), t)
    est.logits = tokens * vocab_local * (c + 4)
    est.batch = rows * t * 4 * 8 * cfg.train.grad_accum  # int32/f32 inputs of the whole update
    if is_rl(cfg) and cfg.rollout.placement == "colocated":
        r, g = cfg.rollout, cfg.grpo
        rb = 2 if r.dtype in ("bfloat16", "auto") else 4
        total_params = sum(math.prod(g_) for g_, _, _ in shapes.values())
        n_dev = math.prod(mesh_sizes.values())
        if r.engine == "vllm":
            engines = max(1, n_dev // r.tensor_parallel_size)
            est.rollout_weights = total_params * rb / r.tensor_parallel_size
            seqs = g.prompts_per_step * g.group_size / engines
            kv = (2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * rb
                  / r.tensor_parallel_size)
            kv_all = seqs * t * kv
            est.vllm_needed = est.rollout_weights + kv_all
            budget = r.gpu_memory_utilization * hbm
            est.notes.append(
                f"vLLM reserves gpu_memory_utilization x memory = {budget / GB:.1f} GB per device "
                f"for its weights ({est.rollout_weights / GB:.1f} GB) and KV cache (all "
                f"{g.prompts_per_step * g.group_size} sequences at once need "
                f"{kv_all / GB:.1f} GB; vLLM queues what does not fit)")
            est.rollout_kv = max(0.0, budget - est.rollout_weights)
            if cfg.plan.accelerator in GPU_KINDS:
                # vLLM in processes of its own beside the trainer's: two pools, each fixed
                est.jax_share = cfg.memory_fraction() * hbm
                est.contexts = 2 * CUDA_CONTEXT
                if r.weight_transfer("gpu") == "ipc":
                    est.staging = (r.bucket_mb << 20) * 1.0
                est.notes.append(
                    f"JAX preallocates trainer.memory_fraction x memory = {est.jax_share / GB:.1f} GB "
                    f"per GPU for the trainer ({est.trainer / GB:.1f} GB estimated); vLLM's "
                    f"processes hold gpu_memory_utilization x memory beside it; the rest "
                    f"({(1 - cfg.memory_fraction() - r.gpu_memory_utilization) * hbm / GB:.1f} GB) "
                    f"holds the CUDA contexts and the sync's staging buffer "
                    f"({(est.contexts + est.staging) / GB:.1f} GB)")
                if r.sleep_level:
                    est.notes.append("rollout.sleep_level frees vLLM's memory during the update, "
                                     "but JAX's pool is preallocated at start: the trainer gains "
                                     "nothing unless XLA_PYTHON_CLIENT_ALLOCATOR=platform")
        else:
            est.rollout_weights = pbytes  # the colocated JAX engine copies the (sharded) weights
            seqs = g.prompts_per_step * g.group_size
            if r.max_rows:  # the engine decodes at most max_rows sequences per program
                seqs = min(seqs, max(r.max_rows // g.group_size, 1) * g.group_size)
            seqs /= batch_shards
            from rollout.jax_engine import bucket_mult, phase_ends

            # a decode in phases grows its cache: at the last boundary the grown cache and the
            # one before it (short of the last phase's slots) coexist
            ends = phase_ends(bucket_mult(g.max_tokens), r.decode_phases)
            held = t + (max(0, t - (ends[-1] - ends[-2])) if len(ends) > 1 else 0)
            # int8: a byte per value and an f32 scale per head_dim values
            per_value = ((1 + 4 / mc.head_dim) if r.kv_cache_dtype == "int8"
                         else 2 if mc.compute_dtype == "bfloat16" else 4)
            est.rollout_kv = seqs * held * 2 * mc.num_hidden_layers * mc.num_key_value_heads \
                * mc.head_dim * per_value / mesh_sizes["tensor"]
    return est


def advice(cfg, mc, est: Estimate, hbm: float, mesh_sizes: dict[str, int],
           share: float = USABLE) -> list[str]:
    """If the plan does not fit: the first line says by how much; each further line is one
    setting, its new value and what it saves ("enough" when that change alone makes it fit).
    `share`: the part of `hbm` that may be filled (`usable`)."""
    budget = share * hbm
    total = est.trainer + est.rollout
    if est.jax_share:  # two fixed pools: the trainer must fit in JAX's, the rest beside both
        r = cfg.rollout
        free = (1 - cfg.memory_fraction() - r.gpu_memory_utilization) * hbm
        if est.contexts + est.staging > free:
            return [f"does not fit: the CUDA contexts and the weight-sync staging need "
                    f"{(est.contexts + est.staging) / GB:.1f} GB per GPU beside JAX's and vLLM's "
                    f"pools, {free / GB:.1f} GB are left",
                    f"rollout.bucket_mb: {r.bucket_mb} -> {max(16, r.bucket_mb // 4)}: the "
                    "staging buffer is one bucket"]
        budget, total = est.jax_share, est.trainer
    if total <= budget:
        return []
    over = total - budget
    where = (f"JAX's pool: trainer.memory_fraction {cfg.memory_fraction():g} of {hbm / GB:.0f} GB"
             if est.jax_share else f"{share:.1%} of {hbm / GB:.1f} GB")
    out = [f"does not fit: {total / GB:.1f} GB needed per device, {budget / GB:.1f} GB usable "
           f"({where}); {over / GB:.1f} GB over"]

    def line(setting: str, saves: float, why: str = "") -> str:
        verdict = "enough" if saves >= over else "not enough alone"
        return f"{setting}: saves {saves / GB:.1f} GB ({verdict}){'; ' + why if why else ''}"

    rows, accum = rows_per_update(cfg), cfg.train.grad_accum
    act = est.activations + est.logits
    for cand in range(accum + 1, rows + 1):
        saves = act * (1 - accum / cand)
        if rows % cand == 0 and (saves >= over or cand == rows):
            out.append(line(f"train.grad_accum: {accum} -> {cand}", saves,
                            f"micro-batches of {rows // cand} sequences"))
            break
    if mc.remat == "none":
        saved = est.activations * (1 - 1 / 6)
        out.append(line("model.remat: none -> full", saved, "recomputes each layer (~1/3 more compute)"))
    static = est.params + est.grads + est.optimizer + est.reference + est.casts
    fsdp = mesh_sizes["fsdp"]
    n = math.prod(mesh_sizes.values())
    out.append(line(f"mesh.ici.fsdp: {fsdp} -> {2 * fsdp} ({2 * n} devices)", static / 2,
                    "parameters, gradients and optimizer state are split twice as far"))
    if is_rl(cfg) and cfg.rollout.placement == "colocated" and est.rollout:
        r = cfg.rollout
        frac = cfg.memory_fraction()
        if est.jax_share and frac + r.gpu_memory_utilization < GPU_SHARE - 0.005:
            most = GPU_SHARE - r.gpu_memory_utilization
            out.append(line(f"trainer.memory_fraction: {frac:g} -> {most:.2f}",
                            (most - frac) * hbm, "what vLLM's share leaves of the GPU"))
        lowest = max(0.05, math.ceil(est.vllm_needed / hbm * 100) / 100)
        if r.engine == "vllm" and lowest < r.gpu_memory_utilization:
            gain = r.gpu_memory_utilization - lowest
            # beside JAX's fixed pool, what vLLM gives back only helps once JAX takes it
            also = (f" with trainer.memory_fraction: {frac:g} -> {frac + gain:.2f}"
                    if est.jax_share else "")
            out.append(line(f"rollout.gpu_memory_utilization: {r.gpu_memory_utilization} -> "
                            f"{lowest}{also}", gain * hbm,
                            "still holds every sequence of a step at once"))
        if r.engine == "jax" and est.rollout_kv:
            out += kv_advice(cfg, mc, est.rollout_kv, line, over)
        out.append(line("rollout.placement: colocated -> disaggregated",
                        (GPU_SHARE - frac) * hbm if est.jax_share else est.rollout,
                        "rollout on devices of its own"))
    return out


def kv_advice(cfg, mc, kv: float, line, over: float) -> list[str]:
    """The colocated JAX engine's KV cache: int8 values, and fewer sequences per decode program
    (`rollout.max_rows`: the most prompts' groups, a divisor of the step's prompts so that the
    calls are equal, that is enough; else one group)."""
    r, g, out = cfg.rollout, cfg.grpo, []
    if r.kv_cache_dtype != "int8":
        now = 2 if mc.compute_dtype == "bfloat16" else 4
        out.append(line("rollout.kv_cache_dtype: auto -> int8",
                        kv * (1 - (1 + 4 / mc.head_dim) / now),
                        "a byte per value and a scale per head; log-probs move by ~5e-3"))
    seqs = g.prompts_per_step * g.group_size
    held = min(seqs, r.max_rows // g.group_size * g.group_size) if r.max_rows else seqs
    for prompts in range(held // g.group_size - 1, 0, -1):
        saves = kv * (1 - prompts * g.group_size / held)
        if (saves >= over and g.prompts_per_step % prompts == 0) or prompts == 1:
            out.append(line(f"rollout.max_rows: {r.max_rows} -> {prompts * g.group_size}", saves,
                            f"{prompts} prompts' groups per decode program, "
                            f"{g.prompts_per_step // prompts} calls a step"))
            break
    return out


# ---- ahead-of-time compile ---------------------------------------------------------------------
def target_devices(topology: str | None, devices: int | None):
    import jax

    if topology:
        from jax.experimental import topologies

        name = TPU_TOPOLOGIES.get(topology, topology)
        # one chip: libtpu's default host of 2x2 chips does not divide it
        host = {"chips_per_host_bounds": (1, 1, 1)} if _topology_devices(topology) == 1 else {}
        try:
            topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **host)
        except Exception as e:  # noqa: BLE001 - libtpu missing or unknown topology
            raise UserError(f"--topology {topology}: libtpu cannot describe it ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]})") from None
        return list(topo.devices)
    have = jax.devices()
    if devices is not None and len(have) < devices:
        raise UserError(f"--devices {devices}: only {len(have)} devices visible (set before JAX starts)")
    return have[:devices] if devices else have


def compile_train_step(cfg, mc, devices, keep_hlo: bool = False) -> dict:
    """Lower and compile the recipe's real train step for `devices`; XLA's per-device bytes (and
    with `keep_hlo` the compiled program's text, `hlo`: `benchmarks.tpu.hlo_cost` reads it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain.compile_cache import resolve_effort
    from posttrain.models.layers import building_for
    from posttrain.models.transformer import CausalLM
    from posttrain.sharding import batch_sharding, make_mesh, state_shardings, use_mesh
    from posttrain.train.optimizer import (
        f32_moments_init,
        lr_schedule,
        make_optimizer,
        opt_state_shardings,
    )
    from posttrain.train.step import TrainState, make_train_step, next_token_loss

    from posttrain.train.trainer import with_adapters

    mesh = make_mesh(cfg.mesh, devices)
    rules = cfg.mesh.rules
    t0 = time.perf_counter()

    def model():  # as the trainer makes it: the adapters over the (frozen) base
        m = CausalLM(mc, nnx.Rngs(0))
        return with_adapters(m, cfg) if cfg.model.lora.rank else m

    def placed(tree):
        sh = state_shardings(tree, mesh, rules)
        return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                            tree, sh)

    # kernels chosen and lowered for the target (splash on one TPU), not for this CPU
    with use_mesh(mesh, rules), building_for(devices[0].platform, len(devices)):
        abstract = nnx.eval_shape(model)
        trainable = nnx.LoRAParam if cfg.model.lora.rank else nnx.Param
        graphdef, params, frozen = nnx.split(abstract, trainable, ...)
        params, frozen = placed(params), placed(frozen)
        steps = cfg.train.steps
        if is_rl(cfg):
            from posttrain.algorithms.grpo import make_loss_fn

            loss_fn, steps = make_loss_fn(cfg), steps * cfg.grpo.mu * cfg.grpo.mini_batches
        else:
            loss_fn = next_token_loss
        optimizer = make_optimizer(cfg.optimizer, steps)
        opt = jax.eval_shape(f32_moments_init(optimizer), params)  # as init_opt_state makes it
        opt = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), opt,
                           opt_state_shardings(opt, params))
        rep = NamedSharding(mesh, PartitionSpec())
        state = TrainState(params, frozen, opt,
                           jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                           jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))
        rows, tl = rows_per_update(cfg), cfg.data.seq_len
        b2, b1 = batch_sharding(mesh, rules, 2), batch_sharding(mesh, rules, 1)
        batch = {k: jax.ShapeDtypeStruct((rows, tl), dt, sharding=b2) for k, dt in (
            ("tokens", jnp.int32), ("targets", jnp.int32), ("positions", jnp.int32),
            ("segment_ids", jnp.int32), ("loss_mask", jnp.float32))}
        if is_rl(cfg):
            per_token = ("logp_old", "logp_rollout") if cfg.grpo.scores_old else ("logp_rollout",)
            batch.update({k: jax.ShapeDtypeStruct((rows, tl), jnp.float32, sharding=b2)
                          for k in per_token})
            batch["advantages"] = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=b1)
            batch["kept_counts"] = jax.ShapeDtypeStruct((rows, tl), jnp.int32, sharding=b2)
            if cfg.grpo.beta > 0:
                batch["logp_ref"] = jax.ShapeDtypeStruct((rows, tl), jnp.float32, sharding=b2)
            if cfg.head_window:  # the head on the completions' window (`build_batch`)
                batch["head_index"] = jax.ShapeDtypeStruct((rows, cfg.head_window), jnp.int32,
                                                           sharding=b2)
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        step = jax.jit(make_train_step(graphdef, optimizer, loss_fn, cfg.train.grad_accum,
                                       lr_schedule(cfg.optimizer, steps)),
                       donate_argnums=0, out_shardings=(state_sh, None))
        lowered = step.lower(state, batch)
        t_lower = time.perf_counter() - t0
        effort = resolve_effort(cfg.train.compile_effort, devices[0].platform, mc.matmul_params())
        prev = jax.config.jax_exec_time_optimization_effort
        jax.config.update("jax_exec_time_optimization_effort", effort)  # as the run compiles it
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # XLA's verdict: the program cannot fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return {"platform": devices[0].platform, "devices": len(devices),
                    "oom": str(e).split("\n")[0].removeprefix("RESOURCE_EXHAUSTED: "),
                    "lower_s": t_lower, "compile_s": time.perf_counter() - t0 - t_lower}
        finally:
            jax.config.update("jax_exec_time_optimization_effort", prev)
    m = compiled.memory_analysis()
    total = program_bytes(m)
    return {"platform": devices[0].platform, "devices": len(devices),
            "device_kind": getattr(devices[0], "device_kind", ""),
            "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes, "total": total,
            "lower_s": t_lower, "compile_s": time.perf_counter() - t0 - t_lower,
            "compile_effort": effort, **({"hlo": compiled.as_text()} if keep_hlo else {})}


# ---- the report ---------------------------------------------------------------------------------
def plan_stage(cfg, *, n_devices: int, accelerator: str, devices=None) -> dict:
    from posttrain.config import mesh_shape

    mc = model_config_for_plan(cfg)
    sizes = mesh_shape(cfg.mesh, n_devices)
    label, hbm = ACCELERATORS[accelerator]
    frac = usable(accelerator)
    est = estimate(cfg, mc, sizes, hbm)
    out = {"stage": cfg.name, "algorithm": cfg.algorithm, "mesh": sizes, "accelerator": label,
           "hbm": hbm, "usable": frac * hbm, "estimate": est,
           "advice": advice(cfg, mc, est, hbm, sizes, frac), "model": mc}
    if devices is not None:
        out["xla"] = x = compile_train_step(cfg, mc, devices)
        if "oom" in x:  # XLA's compile for the device outranks the estimate
            head = f"does not fit: XLA's compile for {x['devices']} {x['platform']} device(s): {x['oom']}"
            out["advice"] = [head] + out["advice"][1:]
    return out


def print_report(r: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    est, mc = r["estimate"], r["model"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    table = Table(title=f"{r['stage']} ({r['algorithm']}): {mc.arch}, "
                  f"{mc.num_hidden_layers} layers; mesh {mesh}; {r['accelerator']}")
    table.add_column("per device")
    table.add_column("GB", justify="right")
    for name, b in est.rows():
        if b:
            table.add_row(name, f"{b / GB:.2f}")
    table.add_row("trainer total", f"{est.trainer / GB:.2f}", style="bold")
    if est.rollout:
        table.add_row("+ colocated rollout", f"{(est.trainer + est.rollout) / GB:.2f}", style="bold")
    if est.jax_share:
        table.add_row("JAX's pool (trainer.memory_fraction)", f"{est.jax_share / GB:.2f}")
    x = r.get("xla")
    if x and "oom" in x:
        table.add_row(f"XLA ({x['platform']}, {x['devices']} devices)", "out of memory",
                      style="bold red")
        x = None
    if x:
        table.add_row(f"XLA ({x['platform']}, {x['devices']} devices): arguments",
                      f"{x['arguments'] / GB:.2f}")
        table.add_row("XLA: temporaries", f"{x['temp'] / GB:.2f}")
        table.add_row("XLA: outputs not aliased to inputs",
                      f"{(x['outputs'] - x['aliased']) / GB:.2f}")
        table.add_row("XLA total (train step)", f"{x['total'] / GB:.2f}", style="bold")
    console.print(table)
    for note in est.notes:
        console.print(f"note: {note}")
    if x:
        ratio = est.trainer / max(x["total"], 1)
        console.print(f"analytical trainer estimate / XLA = {ratio:.2f} "
                      f"(lowered in {x['lower_s']:.1f} s, compiled in {x['compile_s']:.1f} s at "
                      f"effort {x.get('compile_effort', 0):g})")
    if r["advice"]:
        console.print(f"[bold red]{r['advice'][0]}[/]")
        for a in r["advice"][1:]:
            console.print(f"  change: {a}")
    else:
        if est.jax_share:
            console.print(f"[green]fits[/]: the trainer's {est.trainer / GB:.1f} GB in JAX's "
                          f"{est.jax_share / GB:.1f} GB pool per GPU, vLLM beside it")
        else:
            budget = r["usable"]
            console.print(f"[green]fits[/]: {(est.trainer + est.rollout) / GB:.1f} GB of "
                          f"{budget / GB:.1f} GB usable per device")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory and sharding plan of a recipe, before hardware")
    add_recipe_arguments(p)
    p.add_argument("--devices", type=int, help="devices to plan for (GPU/CPU); default: the mesh's")
    p.add_argument("--topology", help="TPU slice to compile for, e.g. v5p-64 or v5p:2x4x4")
    p.add_argument("--accelerator", choices=sorted(ACCELERATORS),
                   help="device memory to fit (default: from --topology, else h100)")
    p.add_argument("--no-compile", action="store_true", help="analytical estimate only")
    p.add_argument("--json", action="store_true", help="one JSON object per stage on stdout")
    p.set_defaults(fn=_cmd_plan, early=_prepare_devices)


def _topology_devices(topology: str) -> int:
    name = TPU_TOPOLOGIES.get(topology, topology)
    dims = name.split(":")[-1].split("x")
    return math.prod(int(d) for d in dims)


def libtpu_path() -> str | None:
    """libtpu for compiling against a TPU topology: TPU_LIBRARY_PATH, an importable libtpu (a
    TPU VM), or the private copy in $prefix/libtpu."""
    import importlib.util
    import os
    import sys
    from pathlib import Path

    if os.environ.get("TPU_LIBRARY_PATH"):
        return os.environ["TPU_LIBRARY_PATH"]
    if importlib.util.find_spec("libtpu") is not None:
        return "libtpu"
    private = Path(sys.prefix) / "libtpu" / "libtpu" / "libtpu.so"
    return str(private) if private.is_file() else None


def _prepare_devices(args) -> None:
    """Before JAX starts: libtpu for TPU topologies, a CPU mesh of the planned size for GPUs."""
    import os

    if args.topology and not args.no_compile:
        path = libtpu_path()
        if path is None:
            raise UserError(f"--topology: libtpu is not installed; pip install --no-deps --target "
                            f"\"$VIRTUAL_ENV/libtpu\" {LIBTPU}  (or --no-compile)")
        if path != "libtpu":
            os.environ["TPU_LIBRARY_PATH"] = path
        return
    if args.topology or args.no_compile:
        return
    n = args.devices or _devices_from_recipe(args)
    if n and n > 1:
        flags = os.environ.get("XLA_FLAGS", "")
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"


def _recipe(args) -> tuple[str, list[str]]:
    (recipe,), overrides = recipes_and_overrides(args)
    return recipe, overrides


def _devices_from_recipe(args) -> int | None:
    from posttrain.config import load_recipe, named_devices

    return named_devices(load_recipe(*_recipe(args))[-1])


def _cmd_plan(args) -> int:
    from posttrain.config import load_recipe

    stages = load_recipe(*_recipe(args))
    if args.topology:
        accel = args.accelerator or re.split(r"[-:]", args.topology)[0]
        if accel not in ACCELERATORS:
            raise UserError(f"--topology {args.topology}: unknown accelerator {accel!r}; "
                            f"pass --accelerator")
        n = _topology_devices(args.topology)
    else:
        accel = args.accelerator or stages[-1].plan.accelerator
        n = args.devices or _devices_from_recipe(args)
        if n is None:
            raise UserError("--devices: required when the recipe's mesh has a -1 axis")
    devices = None if args.no_compile else target_devices(args.topology, n)
    fits = True
    for cfg in stages:
        r = plan_stage(cfg, n_devices=n, accelerator=accel, devices=devices)
        if args.json:
            print(json.dumps(as_json(r)))
        else:
            print_report(r)
        fits = fits and not r["advice"]
    return 0 if fits else 1  # 1: does not fit (the advice says what to change)


def as_json(r: dict) -> dict:
    est = r["estimate"]
    return {"stage": r["stage"], "mesh": r["mesh"], "accelerator": r["accelerator"],
            "estimate": dict(est.rows()), "trainer_total": est.trainer,
            "total": est.trainer + est.rollout, "usable": r["usable"],
            "jax_pool": est.jax_share,
            "fits": not r["advice"], "advice": r["advice"], "notes": est.notes,
            "xla": r.get("xla")}
