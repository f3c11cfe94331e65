"""Sharded, rematerialised and scanned/unrolled variants compute the same loss and gradients.

Meshes use the 8 fake CPU devices of conftest. Tolerance: 1e-5 relative (norm of the difference
over the norm of the reference, per parameter): sharded matmuls reduce in a different order, which
moves fp32 results by ~1e-7 relative; anything structural (a wrong mask, a missing all-reduce)
shows up at 1e-2 or more.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.config import DEFAULT_RULES, MeshAxes, MeshSection
from posttrain.models import ModelConfig, build_model
from posttrain.sharding import batch_sharding, make_mesh, state_shardings, use_mesh
from posttrain.train.step import next_token_loss

CFG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def batch(b=8, t=32, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 256, (b, t)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    seg[:, t // 2:] = 2  # two packed segments per row
    pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0)
    return {"tokens": tok, "targets": np.roll(tok, -1, 1), "positions": pos.astype(np.int32),
            "segment_ids": seg, "loss_mask": np.ones((b, t), np.float32)}


def same_weights_model(cfg: ModelConfig):
    """A model of `cfg` holding the weights of the scanned seed-0 reference, whatever its layout."""
    ref = build_model(CFG, seed=0)
    if cfg.scan_layers:
        model = build_model(cfg, seed=0)
    else:  # move the stacked weights through the HF name map into the per-layer layout
        from posttrain.models.export import param_flat
        from posttrain.models.hf import hf_to_nnx, nnx_to_hf
        from posttrain.models.loading import abstract_model, set_params

        hf = dict(nnx_to_hf(CFG, {k: np.asarray(v[...]) for k, v in param_flat(ref).items()}))
        model = set_params(abstract_model(cfg), hf_to_nnx(cfg, hf.__getitem__))
    return model


def loss_and_grads(cfg: ModelConfig, mesh=None):
    model = same_weights_model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    b = batch()

    def f(p, bt):
        s, n, _ = next_token_loss(nnx.merge(graphdef, p), bt)
        return s / n

    if mesh is None:
        loss, g = jax.jit(jax.value_and_grad(f))(params, b)
        return float(loss), nnx.to_pure_dict(g), None
    with use_mesh(mesh, DEFAULT_RULES):
        shard = state_shardings(params, mesh, DEFAULT_RULES)
        params = jax.device_put(params, shard)
        b = jax.device_put(b, batch_sharding(mesh, DEFAULT_RULES, 2))
        loss, g = jax.jit(jax.value_and_grad(f))(params, b)
    return float(loss), nnx.to_pure_dict(g), params


def assert_close_tree(got, want, rtol=1e-5):
    flat_g, flat_w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_g) == len(flat_w)
    for a, b in zip(flat_g, flat_w):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b) + 1e-12


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(CFG)


@pytest.mark.parametrize("axes", [dict(fsdp=8), dict(fsdp=4, tensor=2),
                                  dict(data=2, fsdp=2, tensor=2)], ids=str)
def test_sharded_step_matches_single_device(reference, axes):
    assert jax.device_count() == 8
    mesh = make_mesh(MeshSection(ici=MeshAxes(**{"fsdp": 1, **axes})))
    loss, grads, params = loss_and_grads(CFG, mesh)
    assert abs(loss - reference[0]) <= 1e-5 * abs(reference[0])
    assert_close_tree(grads, reference[1])
    # the parameters are laid out as the rules table says
    q = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    emb = params["model"]["embed_tokens"]["embedding"]
    fs = "fsdp" if axes.get("fsdp", 1) > 1 else None
    tp = "tensor" if axes.get("tensor", 1) > 1 else None
    assert q.sharding.spec == P(None, fs, tp)  # (layers, embed, heads)
    assert emb.sharding.spec == P(tp, fs)  # (vocab, embed)


@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch", "save_qkv_proj",
                                   "save_out_proj", "save_qkvo"])
@pytest.mark.parametrize("scan", [True, False])
def test_remat_and_scan_do_not_change_the_math(reference, remat, scan):
    loss, grads, _ = loss_and_grads(CFG.model_copy(update=dict(remat=remat, scan_layers=scan)))
    assert abs(loss - reference[0]) <= 1e-5 * abs(reference[0])
    if not scan:  # unrolled params are per layer: stack them to compare with the scanned layout
        layers = grads["model"]["layers"]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *[layers[i] for i in sorted(layers)])
        grads = {**grads, "model": {**grads["model"], "layers": stacked}}
    assert_close_tree(grads, reference[1])


def test_optimizer_state_is_sharded_like_the_parameters():
    """Adam's moments follow their parameters' layout (jit(optimizer.init) alone would put
    them, unsharded, on one device)."""
    from posttrain.config import OptimizerSection
    from posttrain.train.optimizer import init_opt_state, make_optimizer

    mesh = make_mesh(MeshSection(ici=MeshAxes(fsdp=4, tensor=2)))
    with use_mesh(mesh, DEFAULT_RULES):
        params = nnx.state(build_model(CFG, seed=0), nnx.Param)
        params = jax.device_put(params, state_shardings(params, mesh, DEFAULT_RULES))
        opt = init_opt_state(make_optimizer(OptimizerSection(), 10), params)
    want = {jax.tree_util.keystr(p): a.sharding
            for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    moments = [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_flatten_with_path(opt)[0]
               if a.ndim >= 1]
    assert len(moments) == 2 * len(want)  # mu and nu
    for key, m in moments:
        (param_key,) = [k for k in want if key.endswith(k)]
        assert m.sharding == want[param_key], key
    assert any(m.sharding.spec != P() for _, m in moments)


@pytest.mark.parametrize("int8_base", [False, True], ids=["lora", "lora-int8"])
def test_lora_trains_under_remat(int8_base):
    """LoRA with remat: the adapters' loss and gradients equal those without remat. Before the
    unrolled layers ran under `jax.checkpoint` (`transformer._remat_layer_call`, not `nnx.remat`)
    and qwix's first call without remat (`models.qwix_apply`), a
    jitted LoRA step with any remat policy raised flax's TraceContextError: LoRA recipes could
    not use remat at all, and an 8B LoRA does not fit a 16 GB chip without it."""
    from tests.helpers import with_lora

    b = jax.tree.map(jnp.asarray, batch(b=2))
    out = {}
    for remat in ("none", "full", "save_qkv_proj"):
        model = with_lora(build_model(CFG.model_copy(update=dict(remat=remat, scan_layers=False))),
                          int8_base=int8_base)
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        f = jax.jit(jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), b)[0]))
        out[remat] = f(lora)
    ref_loss, ref_grads = out.pop("none")
    for loss, grads in out.values():
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert_close_tree(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads))


def test_every_remat_name_a_config_accepts_has_a_policy():
    from typing import get_args

    from posttrain.models.config import RematPolicy
    from posttrain.models.transformer import REMAT_POLICIES

    assert set(get_args(RematPolicy)) == set(REMAT_POLICIES)


def unrolled_like(scanned, unrolled):
    """`unrolled` (a model with unrolled layers) given `scanned`'s values, adapters included:
    layer i of every stacked [L, ...] variable."""
    src = {tuple(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(scanned))}
    out = []
    for p, v in nnx.to_flat_state(nnx.state(unrolled)):
        s = tuple(map(str, p))
        out.append((p, v.replace(src[s[:2] + s[3:]][int(s[2])] if s[:2] == ("model", "layers")
                                 else src[s])))
    nnx.update(unrolled, nnx.from_flat_state(out))
    return unrolled


@pytest.mark.parametrize("int8_base", [False, True], ids=["lora", "lora-int8"])
def test_lora_over_scanned_layers_is_lora_over_unrolled_ones(int8_base):
    """The adapters of a scanned model (`models.qwix_apply`: each layer's made by qwix inside
    the vmap that stacks them, [L, ...] beside their kernels) compute what an unrolled model's
    do (over an int8 base too): the same loss and adapter gradients under remat, every layer
    its own adapters. The
    scanned program holds one layer: the 0.6B LoRA update compiled for a v5e in 165 s with
    28 unrolled layers (BENCHMARKS.md). The colocated engine decodes the scanned policy as
    its unrolled twin with the adapters merged into the (dequantized) kernels: it scores as
    the policy."""
    from rollout.jax_engine import JaxEngine, score_sequences
    from tests.helpers import with_lora

    b = jax.tree.map(jnp.asarray, batch(b=2))
    import qwix

    from posttrain.models import qwix_apply

    fresh = qwix_apply(build_model(CFG.model_copy(update=dict(scan_layers=True))),
                       qwix.LoraProvider(module_path=".*_proj", rank=4, alpha=8.0,
                                         weight_qtype=jnp.int8 if int8_base else None),
                       rngs=nnx.Rngs(0))
    a = [v[...] for p, v in nnx.to_flat_state(nnx.state(fresh, nnx.LoRAParam))
         if p[-1].endswith("lora_a")]
    assert len(a) == 7 and all(x.shape[0] == CFG.num_hidden_layers for x in a)
    assert all(not np.allclose(x[0], x[1]) for x in a)  # each layer drew its own A
    scanned = with_lora(build_model(CFG.model_copy(update=dict(remat="full", scan_layers=True))),
                        int8_base=int8_base)
    unrolled = unrolled_like(scanned, with_lora(build_model(CFG.model_copy(update=dict(
        remat="full", scan_layers=False))), int8_base=int8_base))
    out = []
    for model in (scanned, unrolled):
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        f = jax.jit(jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), b)[0]))
        loss, g = f(lora)
        out.append((float(loss), {tuple(map(str, p)): v[...] for p, v in nnx.to_flat_state(g)}))
    (ls, gs), (lu, gu) = out
    assert abs(ls - lu) <= 1e-5 * abs(lu)
    for p, g in gu.items():  # fp32: summation order alone
        np.testing.assert_allclose(gs[p[:2] + p[3:]][int(p[2])], g, rtol=1e-4, atol=1e-6)
    seqs = [[1, 5, 9, 3, 7, 2], [4, 4, 8]]
    eng = JaxEngine(scanned, lora_scale=8.0 / 4)
    np.testing.assert_allclose(np.asarray(sum(eng.score(seqs), [])),
                               np.asarray(sum(score_sequences(scanned, seqs), [])), atol=1e-5)
    with pytest.raises(ValueError, match="lora_scale"):
        JaxEngine(scanned)


def test_lora_for_some_layers_only_asks_for_unrolled_layers():
    import qwix

    from posttrain.models import qwix_apply

    provider = qwix.LoraProvider(module_path=r"model/layers/0/.*_proj", rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="scan_layers: false"):
        qwix_apply(build_model(CFG.model_copy(update=dict(scan_layers=True))), provider,
                   rngs=nnx.Rngs(0))
