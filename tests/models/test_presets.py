"""Presets against the published HF config.json values (copied here: nothing can be downloaded)."""

import pytest

from posttrain.models import ModelConfig

# (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tie, rope_theta, eps)
HF = {
    "qwen3_0_6b": (1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, 1e-6),
    "qwen3_1_7b": (2048, 6144, 28, 16, 8, 128, 151936, True, 1e6, 1e-6),
    "qwen3_4b": (2560, 9728, 36, 32, 8, 128, 151936, True, 1e6, 1e-6),
    "qwen3_8b": (4096, 12288, 36, 32, 8, 128, 151936, False, 1e6, 1e-6),
    "qwen3_14b": (5120, 17408, 40, 40, 8, 128, 151936, False, 1e6, 1e-6),
    "qwen3_32b": (5120, 25600, 64, 64, 8, 128, 151936, False, 1e6, 1e-6),
    "qwen3_30b_a3b": (2048, 6144, 48, 32, 4, 128, 151936, False, 1e6, 1e-6),
    "qwen3_235b_a22b": (4096, 12288, 94, 64, 4, 128, 151936, False, 1e6, 1e-6),
    "llama3_2_1b": (2048, 8192, 16, 32, 8, 64, 128256, True, 5e5, 1e-5),
    "llama3_2_3b": (3072, 8192, 28, 24, 8, 128, 128256, True, 5e5, 1e-5),
    "llama3_1_8b": (4096, 14336, 32, 32, 8, 128, 128256, False, 5e5, 1e-5),
    "llama3_1_70b": (8192, 28672, 80, 64, 8, 128, 128256, False, 5e5, 1e-5),
}
# (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob)
MOE = {"qwen3_30b_a3b": (128, 8, 768, True), "qwen3_235b_a22b": (128, 8, 1536, True)}
LLAMA_SCALING = {"llama3_2_1b": 32.0, "llama3_2_3b": 32.0, "llama3_1_8b": 8.0, "llama3_1_70b": 8.0}


@pytest.mark.parametrize("name", sorted(HF))
def test_preset_matches_hf(name):
    c = ModelConfig.preset(name)
    got = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
           c.num_key_value_heads, c.head_dim, c.vocab_size, c.tie_word_embeddings, c.rope_theta,
           c.rms_norm_eps)
    assert got == HF[name]
    if name in LLAMA_SCALING:
        s = c.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor,
                s.original_max_position_embeddings) == (LLAMA_SCALING[name], 1.0, 4.0, 8192)
    if name in MOE:
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                c.norm_topk_prob) == MOE[name] and c.arch == "qwen3_moe"
    # the HF config we would write reads back to the same architecture
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c


def test_param_counts_of_real_sizes():
    """Shape-only instantiation (no memory) gives the published parameter counts."""
    import jax
    from flax import nnx

    from posttrain.models import CausalLM

    def count(name):
        m = nnx.eval_shape(lambda: CausalLM(ModelConfig.preset(name), nnx.Rngs(0)))
        return sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))

    assert abs(count("qwen3_0_6b") - 596_049_920) < 1e5
    assert abs(count("llama3_1_8b") - 8_030_261_248) < 1e5
    # Qwen3 MoE model cards: 30.5B total (3.3B activated), 235B total (22B activated)
    assert round(count("qwen3_30b_a3b") / 1e9, 1) == 30.5
    assert round(count("qwen3_235b_a22b") / 1e9) == 235
