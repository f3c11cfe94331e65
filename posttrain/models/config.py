"""Model configuration: the architecture hyper-parameters, and named presets for real sizes.

A model receives this config, never the run config. Field names follow HF's `config.json` where
one exists, so that `from_hf_config` / `to_hf_config` are near-identity maps, and the presets are
checked against the published HF values in tests/models/test_presets.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RopeScaling(BaseModel):
    """Llama 3.1/3.2 `llama3` RoPE scaling (the only scaling these architectures publish)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# remat policies by name (`transformer.REMAT_POLICIES`); the recipe's `model.remat` takes the same
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "save_qkv_proj", "save_out_proj",
                      "save_qkvo", "save_attention", "save_qkvo_attention"]


class ModelConfig(BaseModel):
    """Hyper-parameters of one decoder-only transformer (Qwen3 dense, Qwen3 MoE, Llama 3)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: Literal["qwen3", "qwen3_moe", "llama3"] = "qwen3"
    vocab_size: int = Field(512, gt=0)
    hidden_size: int = Field(256, gt=0)
    intermediate_size: int = Field(768, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(64, gt=0)
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    # Mixture of experts (qwen3_moe): every layer's MLP is `num_experts` experts of width
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token.
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = Field(0.001, ge=0, description="load-balancing loss weight")
    router_z_loss_coef: float = Field(0.0, ge=0, description="router z-loss weight (ST-MoE)")
    # Implementation switches (not architecture): they never change the function computed.
    scan_layers: bool = True
    remat: RematPolicy = "none"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "splash", "pallas"] = Field(
        "auto", description="auto: the Pallas splash kernel on a TPU in training and scoring, "
        "XLA's formulation elsewhere and in decode; splash: that kernel anywhere (off a TPU "
        "interpreted: tests); pallas: splash and the Pallas decode kernel over the KV cache "
        "(`posttrain.models.decode_attention`; slower than XLA's decode on a v5e so far: "
        "BENCHMARKS.md)")
    kv_layout: Literal["auto", "ds", "sd", "skbd"] = Field(
        "auto", description="how a KV cache holds its keys: ds, transposed [B, K, D, S] (XLA:CPU "
        "runs q @ K 2.8x faster in a decode step than over [.., S, D]); sd, slot-major "
        "[B, K, S, D] like the values (a decode step writes each slot as a row of D lanes in "
        "place, where XLA:TPU rewrote a transposed key buffer's every tile per step: 36% of the "
        "0.6B int8 decode at 128 rows on a v5e, BENCHMARKS.md); skbd: keys and values "
        "[S, K, B, D], slot outermost (MaxText's autoregressive cache order: a decode step "
        "writes whole tiles, but the attention's scores read it slower: 7.66 against sd's 7.46 ms "
        "per step at 128 rows on a v5e; the Pallas decode kernel does not read it); auto: sd on "
        "a TPU, ds elsewhere (`layers.kv_layout`)")
    head_chunk_tokens: int = Field(0, ge=0, description="tokens whose logits the loss computes "
                                   "at once (`posttrain.train.step.head_chunk`); 0: chosen from "
                                   "the vocabulary size")
    fused_head_loss: bool = Field(
        True, description="the next-token loss runs the LM head itself and forms its gradients "
        "in the forward (`posttrain.train.step.fused_head_nll`: 6 N_head FLOPs per token, not "
        "the chunked head's 8); off where qwix wraps the head (int8 QAT, LoRA on lm_head)")
    head_major_qkv: bool = Field(
        True, description="the splash path projects q/k/v straight to head-major [B, H, T, D] "
        "with an einsum over each kernel (`layers.dense_heads`), not the Linear's own call; off "
        "where qwix intercepts that call on every projection (int8 QAT)")
    moe_impl: Literal["ragged", "dense"] = Field(
        "ragged", description="ragged: tokens sorted by expert, grouped matmul (ragged_dot); "
        "dense: every expert on every token, weighted (tiny models, tests)")

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.is_moe and not (self.moe_intermediate_size > 0
                                and 0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("qwen3_moe needs moe_intermediate_size > 0 and "
                             "0 < num_experts_per_tok <= num_experts")
        return self

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3_moe"

    @property
    def qk_norm(self) -> bool:
        # Qwen3 normalises queries and keys per head before RoPE; Llama 3 does not.
        return self.arch in ("qwen3", "qwen3_moe")

    def matmul_params(self) -> int:
        """Weights one token multiplies: every layer's projections (q, k, v, o, and the MLP's
        gate, up, down: of its routed experts in a MoE) and the LM head; the embedding lookup
        is not a matmul. 2x this is a token's forward FLOPs outside attention."""
        e, h, k, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        mlp = (3 * e * self.moe_intermediate_size * self.num_experts_per_tok if self.is_moe
               else 3 * e * self.intermediate_size)
        return self.num_hidden_layers * (2 * e * h * d + 2 * e * k * d + mlp) + self.vocab_size * e

    # ---- presets: named constructors for the published sizes --------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        ctor = PRESETS.get(name)
        if ctor is None:
            raise KeyError(name)
        return ctor().model_copy(update=overrides)

    @classmethod
    def qwen3(cls, hidden, inter, layers, heads, kv, tie, **kw) -> "ModelConfig":
        return cls(arch="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                   head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=tie, max_position_embeddings=40960, **kw)

    @classmethod
    def qwen3_moe(cls, hidden, inter, moe_inter, layers, heads, kv, experts, top_k) -> "ModelConfig":
        return cls.qwen3(hidden, inter, layers, heads, kv, False).model_copy(update=dict(
            arch="qwen3_moe", moe_intermediate_size=moe_inter, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=True, router_aux_loss_coef=0.001))

    @classmethod
    def llama3(cls, hidden, inter, layers, heads, kv, tie, factor, head_dim=128) -> "ModelConfig":
        return cls(arch="llama3", vocab_size=128256, hidden_size=hidden, intermediate_size=inter,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                   head_dim=head_dim, rope_theta=500_000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=tie, max_position_embeddings=131072,
                   rope_scaling=RopeScaling(factor=factor))

    # ---- HF config.json <-> ModelConfig ---------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> "ModelConfig":
        model_type = hf.get("model_type")
        arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported HF model_type {model_type!r} "
                             "(supported: qwen3, qwen3_moe, llama)")
        moe = {}
        if arch == "qwen3_moe":
            if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
                raise ValueError("qwen3_moe with dense layers (decoder_sparse_step != 1 or "
                                 "mlp_only_layers) is not supported; every layer must be sparse")
            moe = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")), num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["moe_intermediate_size"],
                       norm_topk_prob=hf.get("norm_topk_prob", True),
                       router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
        scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
        rope_scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            rope_scaling = RopeScaling(
                factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                high_freq_factor=scaling["high_freq_factor"],
                original_max_position_embeddings=scaling["original_max_position_embeddings"])
        return cls(
            arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=rope_theta, rope_scaling=rope_scaling, rms_norm_eps=hf["rms_norm_eps"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 40960), **moe, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        common = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
            attention_bias=False, torch_dtype=self.param_dtype,
        )
        if self.arch == "qwen3":
            return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **common)
        if self.arch == "qwen3_moe":
            return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                        num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        moe_intermediate_size=self.moe_intermediate_size,
                        norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                        mlp_only_layers=[], router_aux_loss_coef=self.router_aux_loss_coef,
                        **common)
        scaling = self.rope_scaling.model_dump() if self.rope_scaling else None
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], mlp_bias=False,
                    rope_scaling=scaling, **common)


PRESETS = {
    "qwen3_0_6b": lambda: ModelConfig.qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3_1_7b": lambda: ModelConfig.qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3_4b": lambda: ModelConfig.qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3_8b": lambda: ModelConfig.qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3_14b": lambda: ModelConfig.qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3_32b": lambda: ModelConfig.qwen3(5120, 25600, 64, 64, 8, False),
    "qwen3_30b_a3b": lambda: ModelConfig.qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
    "qwen3_235b_a22b": lambda: ModelConfig.qwen3_moe(4096, 12288, 1536, 94, 64, 4, 128, 8),
    "llama3_2_1b": lambda: ModelConfig.llama3(2048, 8192, 16, 32, 8, True, 32.0, head_dim=64),
    "llama3_2_3b": lambda: ModelConfig.llama3(3072, 8192, 28, 24, 8, True, 32.0),
    "llama3_1_8b": lambda: ModelConfig.llama3(4096, 14336, 32, 32, 8, False, 8.0),
    "llama3_1_70b": lambda: ModelConfig.llama3(8192, 28672, 80, 64, 8, False, 8.0),
}
