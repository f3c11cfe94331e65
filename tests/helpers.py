"""Builders for tiny local HF models (random weights, saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_hf_config(arch: str = "qwen3", *, tie: bool = True, heads: int = 4, kv: int = 2,
                   layers: int = 2, vocab: int = 256, hidden: int = 128, head_dim: int = 64,
                   inter: int = 256, rope_scaling: bool = False):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=tie,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        return Qwen3Config(rope_theta=10000.0, **common)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64) if rope_scaling else None
    return LlamaConfig(rope_theta=500000.0, rope_scaling=scaling, **common)


def save_tiny_hf_model(path: Path, arch: str = "qwen3", seed: int = 0, **kw):
    """Random tiny model saved as safetensors; returns the torch model (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    # HF initialises norms to 1; randomise them so that a missed norm would show in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def torch_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids),
                    attention_mask=None if mask is None else torch.tensor(mask))
    return out.logits.float().numpy()


def save_tiny_model_with_tokenizer(path: Path, arch: str = "qwen3", seed: int = 0, **kw):
    """A tiny random HF model plus a locally trained BPE tokenizer (vocab 512) in one directory,
    loadable by transformers, vLLM and `posttrain.models.from_pretrained`."""
    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe

    tok = train_bpe(generated.corpus_for_tokenizer(99), 512, Path(path))
    kw.setdefault("vocab", 512)
    model = save_tiny_hf_model(path, arch, seed, **kw)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.generation_config.save_pretrained(path)
    return model, tok


def padded_batch(lengths: list[int], width: int, seed: int = 0, vocab: int = 256):
    """Right-padded random token rows of the given lengths, and their attention mask."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, vocab, n)
        mask[i, :n] = 1
    return ids, mask


def assert_padded_logits_match(ref, ours, lengths: list[int], width: int, tol: float, seed: int = 0):
    """Our logits on a padded batch equal transformers' on every real (unpadded) position."""
    import jax.numpy as jnp

    ids, mask = padded_batch(lengths, width, seed)
    want = torch_logits(ref, ids, mask)
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32), segment_ids_bt=jnp.asarray(mask, jnp.int32)))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=tol, rtol=0)


def with_lora(model, int8_base: bool = False, modules: str = ".*(q_proj|v_proj|down_proj)"):
    """`model` with rank-4 LoRA adapters (alpha 8; over an int8 base if asked), trained: B is
    drawn non-zero, where a fresh adapter's zero B would make every path agree by accident."""
    import jax
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    provider = qwix.LoraProvider(module_path=modules, rank=4, alpha=8.0,
                                 weight_qtype=jnp.int8 if int8_base else None)
    from posttrain.models import qwix_apply

    policy = qwix_apply(model, provider, rngs=nnx.Rngs(0))
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))):
        var[...] = 0.05 * jax.random.normal(jax.random.key(i), var[...].shape, var[...].dtype)
    return policy
