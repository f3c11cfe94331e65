"""Qwen3 MoE: logits parity with transformers' Qwen3MoeForCausalLM, ragged == dense, the router's
load-balancing loss against HF's, and expert-parallel sharding == one device.

Tolerances as in test_parity (1e-4 absolute on logits, fp32 on both sides) and
test_sharding_remat (1e-5 relative on loss and gradients). Router weights are drawn with a
larger scale than HF's init so that no two experts tie in the top-k (a tie broken differently by
torch and XLA would change the routing, not measure an error).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.config import DEFAULT_RULES, MeshAxes, MeshSection
from posttrain.models import ModelConfig, from_pretrained
from posttrain.sharding import batch_sharding, make_mesh, state_shardings, use_mesh
from posttrain.train.step import next_token_loss
from tests.helpers import assert_padded_logits_match, padded_batch

TOL = 1e-4
CASES = [dict(experts=4, top_k=2, norm=True), dict(experts=8, top_k=1, norm=False),
         dict(experts=8, top_k=3, norm=True)]


def save_tiny_moe(path, experts, top_k, norm, seed=0, layers=2, head_dim=16):
    """head_dim 64 for vLLM's CPU attention, which has no kernel for 16."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=norm, max_position_embeddings=256, rope_theta=10000.0,
                         tie_word_embeddings=False, router_aux_loss_coef=0.01)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    return save_tiny_moe(path, **request.param), path


@pytest.mark.parametrize("impl,scan", [("ragged", True), ("dense", True), ("ragged", False)])
def test_logits_match_transformers(pair, impl, scan):
    ref, path = pair
    ours = from_pretrained(path, scan_layers=scan, moe_impl=impl)
    assert_padded_logits_match(ref, ours, [29, 17, 6], 32, TOL)


def test_load_balancing_loss_matches_transformers(pair):
    import torch

    ref, path = pair
    ours = from_pretrained(path)
    ids, mask = padded_batch([29, 17, 6], 32, seed=1)
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  output_router_logits=True)
    _, losses = ours(jnp.asarray(ids, jnp.int32), segment_ids_bt=jnp.asarray(mask, jnp.int32),
                     with_router_losses=True)
    np.testing.assert_allclose(float(losses["router_load_balance"]), float(out.aux_loss), rtol=1e-5)
    assert float(losses["router_z_loss"]) > 0


def loss_grads(model, batch):
    graphdef, params = nnx.split(model, nnx.Param)

    def f(p):
        s, n, aux = next_token_loss(nnx.merge(graphdef, p), batch)
        return s / n, aux

    (loss, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return float(loss), aux, g


def lm_batch(b=8, t=16, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 256, (b, t)).astype(np.int32)
    return {"tokens": tok, "targets": np.roll(tok, -1, 1),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
            "segment_ids": np.ones((b, t), np.int32), "loss_mask": np.ones((b, t), np.float32)}


CFG = ModelConfig(arch="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  tie_word_embeddings=False, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)


def test_ragged_equals_dense_in_loss_and_gradients():
    from posttrain.models import build_model

    b = lm_batch()
    loss_r, aux_r, g_r = loss_grads(build_model(CFG, seed=1), b)
    loss_d, aux_d, g_d = loss_grads(build_model(CFG.model_copy(update={"moe_impl": "dense"}), seed=1), b)
    assert abs(loss_r - loss_d) <= 1e-6 * abs(loss_d)
    assert "router_load_balance" in aux_r and "router_z_loss" in aux_r
    for a, w in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d)):
        assert np.linalg.norm(np.asarray(a) - np.asarray(w)) <= 1e-5 * np.linalg.norm(np.asarray(w)) + 1e-12
    # the router's weights get gradient from the balancing loss and the LM loss
    assert np.abs(np.asarray(g_r["model"]["layers"]["mlp"]["gate"]["kernel"][...])).sum() > 0


@pytest.mark.parametrize("impl,axes", [("ragged", dict(expert=8)), ("ragged", dict(fsdp=2, expert=4)),
                                       ("ragged", dict(expert=2, tensor=2, fsdp=2)),
                                       ("dense", dict(expert=2, tensor=2, fsdp=2))], ids=str)
def test_expert_parallel_matches_single_device(impl, axes):
    from posttrain.models import build_model

    cfg = CFG.model_copy(update={"moe_impl": impl})
    b = lm_batch()
    loss, _, grads = loss_grads(build_model(cfg, seed=2), b)
    mesh = make_mesh(MeshSection(ici=MeshAxes(**{"fsdp": 1, **axes})))
    model = build_model(cfg, seed=2)
    graphdef, params = nnx.split(model, nnx.Param)
    with use_mesh(mesh, DEFAULT_RULES):
        params = jax.device_put(params, state_shardings(params, mesh, DEFAULT_RULES))
        sb = jax.device_put(b, batch_sharding(mesh, DEFAULT_RULES, 2))

        def f(p, bt):
            s, n, _ = next_token_loss(nnx.merge(graphdef, p), bt)
            return s / n

        sloss, sgrads = jax.jit(jax.value_and_grad(f))(params, sb)
    experts = params["model"]["layers"]["mlp"]["experts"]["gate_proj"]
    assert experts.sharding.spec[1] == "expert"  # (layers, expert, embed, mlp)
    assert abs(float(sloss) - loss) <= 1e-5 * abs(loss)
    for a, w in zip(jax.tree.leaves(sgrads), jax.tree.leaves(grads)):
        assert np.linalg.norm(np.asarray(a) - np.asarray(w)) <= 1e-5 * np.linalg.norm(np.asarray(w)) + 1e-12
