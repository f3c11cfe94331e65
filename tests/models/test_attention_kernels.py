"""The Pallas splash attention kernel (TPU; interpreted here) against the XLA formulation the
model uses elsewhere: values and gradients at every real token, with packed segments
(positions restarting per segment), GQA ratios 1, 2 and 4, and padding at the end of a row.
The Pallas decode kernel against the same formulation over a KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models.layers import attention_mask, dot_attention, splash_attention


def inputs(b=2, t=128, h=4, kh=2, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s).astype(np.float32))
               for s in ((b, t, h, d), (b, t, kh, d), (b, t, kh, d)))
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    seg[0, :50], seg[0, 50:110] = 1, 2  # two packed sequences, then padding
    pos[0, :50], pos[0, 50:110] = np.arange(50), np.arange(60)
    seg[1, :] = 1  # one full-length sequence
    pos[1] = np.arange(t)
    return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


def splash(q, k, v, seg):
    """`splash_attention` given [B, T, heads, D] operands, as `xla_attention` takes them."""
    q = q * (1 / np.sqrt(q.shape[-1]))
    return splash_attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), seg)


def xla_attention(q, k, v, seg, pos):
    mask = attention_mask(pos, seg, pos, seg)
    return dot_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)


@pytest.mark.parametrize("h,kh,t,block,fused", [
    (4, 4, 128, 1024, True), (4, 2, 128, 1024, True),
    (4, 1, 200, 1024, True),  # between tiles: padded to 256 inside the call
    (4, 2, 256, 128, False)])  # 2 x 2 tiles, dQ in a kernel of its own (the default fuses it)
def test_splash_equals_xla_attention_values_and_gradients(monkeypatch, h, kh, t, block, fused):
    from posttrain.models import layers

    monkeypatch.setattr(layers, "SPLASH_BLOCK", block)
    monkeypatch.setattr(layers, "SPLASH_FUSED_BWD", fused)
    q, k, v, seg, pos = inputs(h=h, kh=kh, t=t)
    real = (seg != 0)[..., None]  # [B, T, 1]
    w = jnp.asarray(np.random.default_rng(1).normal(size=(2, t, h * 32)).astype(np.float32))

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * w * real)

    got = splash(q, k, v, seg)
    want = xla_attention(q, k, v, seg, pos)
    # f32 throughout; the kernel's online softmax sums in other blocks: ~1e-6
    np.testing.assert_allclose(np.asarray(got * real), np.asarray(want * real), atol=1e-5)
    g_got = jax.grad(loss(lambda q, k, v: splash(q, k, v, seg)), (0, 1, 2))(q, k, v)
    g_want = jax.grad(loss(lambda q, k, v: xla_attention(q, k, v, seg, pos)), (0, 1, 2))(q, k, v)
    rows = np.asarray(seg != 0)[..., None, None]  # padding rows differ by design (docstring)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a) * rows, np.asarray(b) * rows, atol=1e-5)


def test_model_with_splash_attention_trains_as_with_xla():
    """`model.attention: splash` in the whole model: the next-token loss and its gradients equal
    the XLA path's (packed rows, scanned layers)."""
    from flax import nnx

    from posttrain.models import build_model
    from posttrain.train.step import next_token_loss
    from tests.models.test_sharding_remat import CFG, batch

    b = {k: jnp.asarray(v[:2]) for k, v in batch(b=8, t=128).items()}
    out = {}
    for impl in ("xla", "splash"):
        graphdef, params = nnx.split(build_model(CFG.model_copy(update={"attention": impl})), nnx.Param)
        f = lambda p: (lambda s, n, _: s / n)(*next_token_loss(nnx.merge(graphdef, p), b))  # noqa: E731
        out[impl] = jax.value_and_grad(f)(params)
    (l_s, g_s), (l_x, g_x) = out["splash"], out["xla"]
    np.testing.assert_allclose(float(l_s), float(l_x), rtol=1e-6)
    for (path, a), (_, w) in zip(nnx.to_flat_state(g_s), nnx.to_flat_state(g_x)):
        a, w = np.asarray(a[...]), np.asarray(w[...])
        assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w) + 1e-9, path


@pytest.mark.parametrize("int8_base,scan", [(False, False), (False, True), (True, False)],
                         ids=["lora", "lora-scanned", "lora-int8"])
def test_the_splash_path_runs_lora_adapters(int8_base, scan):
    """On the splash path q/k/v are projected head-major (`layers.dense_heads`), LoRA adapters
    over a float kernel included (applied there as qwix does, with the layer's `lora_scale`;
    over an int8 base qwix applies them in the Linear's call): a LoRA model (adapters trained,
    so they matter) gives the same loss and adapter gradients with splash as with XLA
    attention, which goes through the Linear's call. Were the adapters skipped or mis-scaled,
    q and v would differ."""
    from flax import nnx

    from posttrain.models import build_model
    from posttrain.train.step import next_token_loss
    from tests.helpers import with_lora
    from tests.models.test_sharding_remat import CFG, assert_close_tree, batch

    b = {k: jnp.asarray(v[:2]) for k, v in batch(b=8, t=128).items()}
    out = {}
    for impl in ("xla", "splash"):
        cfg = CFG.model_copy(update={"attention": impl, "scan_layers": scan})
        model = with_lora(build_model(cfg), int8_base=int8_base)
        q_proj = model.model.layers[0].self_attn.q_proj if not scan else \
            model.model.layers.self_attn.q_proj
        assert q_proj.lora_scale == 2.0  # alpha / rank, for `dense_heads`
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        f = lambda p: (lambda s, n, _: s / n)(*next_token_loss(nnx.merge(graphdef, p, rest), b))  # noqa: E731
        out[impl] = jax.value_and_grad(f)(lora)
    (l_s, g_s), (l_x, g_x) = out["splash"], out["xla"]
    np.testing.assert_allclose(float(l_s), float(l_x), rtol=1e-6)
    assert_close_tree(nnx.to_pure_dict(g_s), nnx.to_pure_dict(g_x))


def test_save_attention_saves_the_splash_kernels_output_for_the_backward(capsys):
    """`model.remat: save_attention` saves the splash kernel's output and log-sum-exp (named
    "attention" by the kernel) for the backward, which then reruns the projections but not the
    kernel's forward (XLA drops it: one forward kernel in the v5e program instead of two,
    `tests/test_gpu_script.py::test_tpu_hlo_cost_reads_the_compilers_estimates_per_loop`; 49 ms
    of a 716 ms 0.6B step on the chip); the loss and gradients equal remat full's. The same for
    `save_qkvo_attention`, which keeps the projections' outputs as well."""
    from flax import nnx
    from jax.ad_checkpoint import print_saved_residuals

    from posttrain.models import build_model
    from posttrain.train.step import next_token_loss
    from tests.models.test_sharding_remat import CFG, batch

    b = {k: jnp.asarray(v[:2]) for k, v in batch(b=8, t=128).items()}
    out = {}
    for remat in ("full", "save_attention", "save_qkvo_attention"):
        cfg = CFG.model_copy(update={"attention": "splash", "remat": remat, "scan_layers": False})
        graphdef, params = nnx.split(build_model(cfg), nnx.Param)
        f = lambda p: (lambda s, n, _: s / n)(*next_token_loss(nnx.merge(graphdef, p), b))  # noqa: E731
        capsys.readouterr()
        print_saved_residuals(f, params)
        saved = [ln for ln in capsys.readouterr().out.splitlines() if "_splash_attention" in ln]
        out[remat] = jax.value_and_grad(f)(params), saved
    assert out["full"][1] == []
    for remat in ("save_attention", "save_qkvo_attention"):
        assert len(out[remat][1]) == 2 * CFG.num_hidden_layers  # output, log-sum-exp
        (l_s, g_s), (l_f, g_f) = out[remat][0], out["full"][0]
        np.testing.assert_allclose(float(l_s), float(l_f), rtol=1e-6)
        for (path, a), (_, w) in zip(nnx.to_flat_state(g_s), nnx.to_flat_state(g_f)):
            a, w = np.asarray(a[...]), np.asarray(w[...])
            assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w) + 1e-9, path


def test_the_attention_is_chosen_in_one_place(monkeypatch):
    from posttrain.models import layers
    from tests.models.test_sharding_remat import CFG

    auto, splash = CFG, CFG.model_copy(update={"attention": "splash"})
    assert layers.attention_impl(auto, 2048, cached=False) == "xla"  # CPU
    with layers.building_for("tpu", 1):  # `posttrain plan --topology v5e-1` on this CPU
        assert layers.attention_impl(auto, 2048, cached=False) == "splash"
    assert layers.attention_impl(auto, 2048, cached=False) == "xla"
    assert layers.attention_impl(splash, 2048, cached=False) == "splash"  # interpreted
    assert layers.attention_impl(splash, 2048, cached=True) == "xla"  # decode: the cache's own
    pallas = CFG.model_copy(update={"attention": "pallas"})
    assert layers.attention_impl(pallas, 2048, cached=False) == "splash"
    assert layers.attention_impl(pallas, 1, cached=True) == "decode"  # the Pallas decode kernel
    assert layers.attention_impl(pallas, 16, cached=True) == "xla"  # a prefill into the cache
    assert layers.attention_impl(splash, 100, cached=False) == "xla"  # under one tile
    assert layers.attention_impl(splash, 288, cached=False) == "splash"  # padded to 384 inside
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(layers.jax, "device_count", lambda: 1)
    assert layers.attention_impl(auto, 2048, cached=False) == "splash"
    assert layers.attention_impl(auto, 1, cached=True) == "xla"  # XLA's decode: faster so far
    with layers.building_for("tpu", 4):  # `posttrain plan --topology v5e-4`: a mesh
        assert layers.attention_impl(auto, 2048, cached=False) == "xla"
    monkeypatch.setattr(layers.jax, "device_count", lambda: 8)  # a mesh: not under shard_map yet
    assert layers.attention_impl(auto, 2048, cached=False) == "xla"


@pytest.mark.parametrize("int8", [False, True])
def test_the_decode_kernel_equals_xla_attention_over_a_cache(int8):
    """One query token per row over a cache of 256 slots in two blocks of 128, a different
    visible window per row (left padding, unwritten slots), GQA 2: the kernel (either
    cache) equals `dot_attention` on the same cache within fp32 summation order."""
    from posttrain.models.decode_attention import decode_attention
    from posttrain.models.layers import MASK_VALUE, quantize_kv

    b, kh, g, d, s = 16, 2, 2, 32, 256
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(b, 1, kh * g, d)).astype(np.float32))
    kt = jnp.asarray(rng.normal(size=(b, kh, d, s)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(b, kh, s, d)).astype(np.float32))
    lo, hi = rng.integers(0, 120, b), rng.integers(130, s + 1, b)
    visible = (np.arange(s) >= lo[:, None]) & (np.arange(s) < hi[:, None])
    mask = jnp.asarray(visible)[:, None, :]
    if int8:
        kt, v = quantize_kv(kt, -2), quantize_kv(v, -1)
    want = dot_attention(q, kt, v, mask)
    qs = (q / np.sqrt(d)).reshape(b, kh, g, d)
    bias = jnp.where(visible, 0.0, MASK_VALUE)
    got = decode_attention(qs, kt, v, bias, rows=8, slots=128)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want), atol=2e-6)
    # a scanned model's stacked cache, read at layer 1 in place: the same as that layer alone
    kt3, v3 = (jax.tree.map(lambda a: jnp.stack([a * 0.5, a, a * 2.0]), x) for x in (kt, v))
    got3 = decode_attention(qs, kt3, v3, bias, jnp.int32(1), rows=8, slots=128)
    np.testing.assert_array_equal(np.asarray(got3), np.asarray(got))
