"""The hand-written backwards of `layers` against autodiff of the plain formulas.

Attention (`layers._attend`): the reference is softmax(mask(q k^T / sqrt(D))) v written with `jax.nn.softmax` and
differentiated by JAX. Rows are packed (two segments, positions restarting), one row is
padding from the middle on (fully masked queries), and heads are grouped (GQA). Tolerance:
1e-5 on values and gradients of order 1, f32: the two compute the same sums in a different
order (the normalisation on the output instead of the probabilities, rowsum(dO * O) instead
of rowsum(P * dP)), which moves results by ~1e-6; a wrong term (a missing row sum, a mask
leaking into the gradient) moves them by 1e-1 or more.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import layers

B, T, H, K, D = 2, 12, 4, 2, 8


def reference(q_bthd, kt_bkds, v_bksd, mask_bts):
    g = H // K
    q = q_bthd.reshape(B, T, K, g, D)
    scores = jnp.einsum("btkgd,bkds->bkgts", q, kt_bkds) / math.sqrt(D)
    scores = jnp.where(mask_bts[:, None, None], scores, layers.MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v_bksd)
    return out.reshape(B, T, H * D)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    kt = rng.normal(size=(B, K, D, T)).astype(np.float32)
    v = rng.normal(size=(B, K, T, D)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] * 7, [1] * 8 + [0] * 4], np.int32)
    pos = np.array([list(range(5)) + list(range(7)), list(range(8)) + [0] * 4], np.int32)
    mask = layers.attention_mask(pos, seg, pos, seg)
    return q, kt, v, mask


def test_values_and_gradients_match_autodiff_of_the_plain_formula():
    q, kt, v, mask = inputs()
    np.testing.assert_allclose(layers.dot_attention(q, kt, v, mask), reference(q, kt, v, mask),
                               atol=1e-5, rtol=1e-5)
    cot = np.random.default_rng(1).normal(size=(B, T, H * D)).astype(np.float32)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a, mask) * cot), argnums=(0, 1, 2))(q, kt, v)

    for name, ours, ref in zip("q kt v".split(), grads(layers.dot_attention), grads(reference)):
        assert np.abs(np.asarray(ref)).max() > 0.1, name  # the check is not vacuous
        np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5, err_msg=name)


def test_masked_keys_get_no_gradient_and_padding_queries_pass_none_back():
    """Keys of another segment or of padding receive nothing from a query that cannot see them;
    with a zero cotangent on padding rows (the loss masks them), their queries get zero too."""
    q, kt, v, mask = inputs()
    cot = np.ones((B, T, H * D), np.float32)
    cot[1, 8:] = 0
    dq, dkt, dv = jax.grad(lambda *a: jnp.sum(layers.dot_attention(*a, mask) * cot),
                           argnums=(0, 1, 2))(q, kt, v)
    assert np.all(np.asarray(dq)[1, 8:] == 0)
    assert np.all(np.asarray(dkt)[1, :, :, 8:] == 0) and np.all(np.asarray(dv)[1, :, 8:] == 0)


def test_bfloat16_cotangents_keep_the_primal_dtypes():
    *qkv, mask = inputs()
    q, kt, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv)
    dq, dkt, dv = jax.grad(lambda *a: jnp.sum(layers.dot_attention(*a, mask).astype(jnp.float32)),
                           argnums=(0, 1, 2))(q, kt, v)
    assert dq.dtype == dkt.dtype == dv.dtype == jnp.bfloat16


def test_swiglu_gradients_match_autodiff_of_silu_times_up():
    """Tolerance 1e-6 on O(1) values: the same elementwise terms, grouped differently."""
    rng = np.random.default_rng(2)
    gate, up, cot = (rng.normal(size=(6, 40)).astype(np.float32) * 3 for _ in range(3))

    def grads(f):
        return jax.grad(lambda g, u: jnp.sum(f(g, u) * cot), argnums=(0, 1))(gate, up)

    np.testing.assert_allclose(layers.swiglu(gate, up), jax.nn.silu(gate) * up, rtol=1e-6)
    for ours, ref in zip(grads(layers.swiglu), grads(lambda g, u: jax.nn.silu(g) * u)):
        np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-6)
