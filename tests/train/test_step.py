"""The pure train step: gradient accumulation equals the full batch; state is donated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.models import build_model
from posttrain.train.step import TrainState, make_train_step, next_token_loss
from tests.models.test_sharding_remat import CFG, batch


def run(grad_accum):
    b = jax.tree.map(jnp.asarray, batch(b=8))
    # uneven token counts per micro-batch: accumulation must divide by the global count
    b["loss_mask"] = b["loss_mask"].at[:4, 10:].set(0.0)
    graphdef, params, rest = nnx.split(build_model(CFG), nnx.Param, ...)
    opt = optax.sgd(1.0)  # the update is minus the gradient: compare gradients through params
    step = jax.jit(make_train_step(graphdef, opt, next_token_loss, grad_accum), donate_argnums=0)
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    new, m = step(state, b)
    return new, m


def test_grad_accumulation_equals_full_batch():
    full, m1 = run(1)
    acc, m4 = run(4)
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    assert float(m4["tokens"]) == float(m1["tokens"])
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert int(acc.step) == 1


def _loss_and_grads(cfg, b):
    model = build_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)

    def f(p):
        s, n, _ = next_token_loss(nnx.merge(graphdef, p), b)
        return s / n

    return jax.value_and_grad(f)(params), graphdef, params


@pytest.mark.parametrize("chunk_tokens,tie", [(16, True), (40, False)])
def test_chunked_head_equals_the_whole_head(chunk_tokens, tie):
    """The loss over the LM head in chunks (8 or 24 positions of 2 rows at a time; 37 positions
    leave a ragged last chunk, padded) equals the loss over the whole [B, T, V] logits, and so
    do its gradients (tied embedding and separate head): fp32, the same arithmetic in other
    shapes, so agreement to summation order (~1e-6 relative)."""
    b = {k: jnp.asarray(v[:2, :37]) for k, v in batch(b=8, t=40).items()}
    base = CFG.model_copy(update={"tie_word_embeddings": tie, "fused_head_loss": False})
    (l_whole, g_whole), _, _ = _loss_and_grads(base.model_copy(update={"head_chunk_tokens": 10**6}), b)
    (l_chunk, g_chunk), _, _ = _loss_and_grads(base.model_copy(update={"head_chunk_tokens": chunk_tokens}), b)
    np.testing.assert_allclose(float(l_chunk), float(l_whole), rtol=1e-6)
    for (path, a), (_, w) in zip(nnx.to_flat_state(g_chunk), nnx.to_flat_state(g_whole)):
        a, w = np.asarray(a[...]), np.asarray(w[...])
        assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w) + 1e-9, path


@pytest.mark.parametrize("chunk_tokens,tie", [(16, True), (40, False), (10**6, True)])
def test_the_fused_head_loss_equals_the_chunked_head(chunk_tokens, tie):
    """`fused_head_nll` (the loss's gradients formed in the forward, chunk by chunk) against the
    whole head through autodiff: the same loss and gradients of every parameter, the head's
    weight (tied embedding or separate) among them, with masked positions (weight 0) and a
    ragged last chunk; fp32, so agreement to summation order (~1e-6 relative)."""
    b = {k: jnp.asarray(v[:2, :37]) for k, v in batch(b=8, t=40).items()}
    b["loss_mask"] = b["loss_mask"].at[0, 5:12].set(0.0)
    base = CFG.model_copy(update={"tie_word_embeddings": tie, "head_chunk_tokens": chunk_tokens})
    (l_ref, g_ref), _, _ = _loss_and_grads(base.model_copy(update={
        "fused_head_loss": False, "head_chunk_tokens": 10**6}), b)
    (l_fused, g_fused), _, _ = _loss_and_grads(base.model_copy(update={"fused_head_loss": True}), b)
    np.testing.assert_allclose(float(l_fused), float(l_ref), rtol=1e-6)
    for (path, a), (_, w) in zip(nnx.to_flat_state(g_fused), nnx.to_flat_state(g_ref)):
        a, w = np.asarray(a[...]), np.asarray(w[...])
        assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w) + 1e-9, path


def test_a_wrapped_head_turns_the_fused_loss_off():
    """int8 QAT's rule and a LoRA target that matches lm_head wrap the head in qwix, which only
    a module call sees: the recipe's switches turn the fused loss off for them."""
    from posttrain.config import ModelSection

    assert ModelSection().switches()["fused_head_loss"]
    assert ModelSection(lora={"rank": 4}).switches()["fused_head_loss"]
    assert not ModelSection(quantization="int8").switches()["fused_head_loss"]
    assert not ModelSection(lora={"rank": 4, "target_modules": ".*(q_proj|lm_head)"}).switches()[
        "fused_head_loss"]


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_head_never_holds_the_whole_logits(fused):
    """No array of the loss's forward or backward has B x T x V elements: the [B, T, V] logits
    (the 10 GB that put a 0.6B model's 16k-token step out of a TPU's memory) are never whole."""
    b = {k: jnp.asarray(v[:2]) for k, v in batch(b=8, t=96).items()}
    # 16 positions of 2 rows at a time; a vocabulary big enough that the logits would be the
    # largest array (as they are in real models)
    cfg = CFG.model_copy(update={"head_chunk_tokens": 32, "vocab_size": 4096,
                                 "fused_head_loss": fused})
    model = build_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    grad = jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), b)[0])
    whole = 2 * 96 * cfg.vocab_size  # more than the embedding's [V, E] (its gradient)

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                yield int(np.prod(getattr(v.aval, "shape", ())))
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    assert max(sizes(jax.make_jaxpr(grad)(params).jaxpr)) < whole
    assert max(sizes(jax.make_jaxpr(lambda p: model(b["tokens"]))(params).jaxpr)) >= whole  # control


def test_head_chunks_split_the_sequence_evenly():
    """The head's chunks are as many as the memory budget needs, of equal length rounded up to a
    multiple of 8: a 2,048-token row of 8 under Qwen3's 152k vocabulary (a 220-position budget)
    runs 10 chunks of 208, not 10 of 220 with the last one 70% padding; never above the budget
    by more than the rounding, never longer than the sequence."""
    from types import SimpleNamespace

    from posttrain.train.step import head_chunk

    for vocab, rows, seq in [(151936, 8, 2048), (151936, 2, 2048), (151936, 1, 8192),
                             (128256, 4, 2048), (151936, 64, 384), (512, 4, 64), (151936, 3, 1000)]:
        cfg = SimpleNamespace(head_chunk_tokens=0, vocab_size=vocab)
        c = head_chunk(cfg, rows, seq)
        budget = max(1, min(seq, (1 << 30) // (4 * vocab) // rows))
        n = -(-seq // c)
        assert n <= -(-seq // budget) and c <= min(seq, budget + 7), (vocab, rows, seq, c)
        assert n * c - seq < 8 * n and (c % 8 == 0 or c == seq or c <= 8), (vocab, rows, seq, c)
    assert head_chunk(SimpleNamespace(head_chunk_tokens=0, vocab_size=151936), 8, 2048) == 208


def test_an_int8_lora_base_made_on_the_host_equals_the_one_made_on_the_device(tmp_path, monkeypatch):
    """On an accelerator a checkpoint under `model.lora.int8_base` is loaded and quantized in
    host memory and only the int8 base and adapters are sent (an 8B's bf16 weights, 16.4 GB,
    do not fit a 16 GB v5e beside their int8 copy). Forced here on the CPU: the same model,
    leaf for leaf, as the direct path (the int8 base, its scales, the adapters)."""
    from posttrain.config import load_recipe
    from posttrain.models.config import ModelConfig
    from posttrain.models.export import save_hf
    from posttrain.models.transformer import CausalLM
    from posttrain.sharding import make_mesh
    from posttrain.train import trainer

    mc = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, scan_layers=True)
    save_hf(CausalLM(mc, nnx.Rngs(3)), tmp_path / "ckpt")
    (cfg,) = load_recipe("recipes/sft_tiny.yaml", [f"model.path={tmp_path / 'ckpt'}",
                                                    "model.config=null", "model.lora.rank=4",
                                                    "model.lora.int8_base=true"])
    mesh = make_mesh(cfg.mesh)
    states = []
    for host in (False, True):
        monkeypatch.setattr(trainer, "base_made_on_host", lambda cfg, host=host: host)
        states.append(jax.tree.leaves(nnx.state(trainer.create_model(cfg, mc, mesh))))
    direct, staged = states
    assert any(x.dtype == jnp.int8 for x in direct) and len(direct) == len(staged)
    for a, b in zip(direct, staged):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_adam_moments_stay_bf16_and_train_like_f32_moments():
    """`optimizer.moments_dtype: bfloat16`: Adam's moments are bf16 from init through jitted,
    donated steps (a state turning f32 after its first update would recompile the step), and
    five steps move the parameters as f32 moments do within bf16's rounding. Tolerance 2e-2 of the update's norm: each stored moment is rounded to 8 bits of
    mantissa (2^-9 relative) and the update mu / sqrt(nu) compounds both over five steps (~1%);
    a wrong moment (a dropped bias correction, nu in place of mu) moves it by 10% or more."""
    from posttrain.config import OptimizerSection
    from posttrain.train.optimizer import init_opt_state, make_optimizer

    b = jax.tree.map(jnp.asarray, batch(b=4))
    moved = {}
    for dtype in ("float32", "bfloat16"):
        graphdef, params, rest = nnx.split(build_model(CFG, seed=0), nnx.Param, ...)
        start = jax.tree.map(np.asarray, params)
        opt = make_optimizer(OptimizerSection(learning_rate=1e-3, schedule="constant",
                                              moments_dtype=dtype), 5)
        state = TrainState(params, rest, init_opt_state(opt, params), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
        step = jax.jit(make_train_step(graphdef, opt, next_token_loss), donate_argnums=0)
        dtypes = jax.tree.map(lambda x: x.dtype, state.opt_state)
        for _ in range(5):
            state, _ = step(state, b)
            assert jax.tree.map(lambda x: x.dtype, state.opt_state) == dtypes
        moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1]
        assert moments and {x.dtype for x in moments} == {jnp.dtype(dtype)}
        moved[dtype] = jax.tree.map(lambda a, s: np.asarray(a) - s, state.params, start)
    ref = np.concatenate([x.ravel() for x in jax.tree.leaves(moved["float32"])])
    got = np.concatenate([x.ravel() for x in jax.tree.leaves(moved["bfloat16"])])
    assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(ref)
