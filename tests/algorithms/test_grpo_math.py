"""GRPO-family functions against numbers worked out by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms import grpo as G

R = np.array([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])


def test_advantages_by_hand():
    np.testing.assert_allclose(G.grpo_advantages(R, 4), [1, -1, 1, -1, 0, 0, 0, 0], atol=1e-5)
    np.testing.assert_allclose(G.drgrpo_advantages(R, 4), [.5, -.5, .5, -.5, 0, 0, 0, 0])
    np.testing.assert_allclose(G.rloo_advantages(R, 4), [2 / 3, -2 / 3, 2 / 3, -2 / 3, 0, 0, 0, 0])
    assert G.informative_groups(R, 4).tolist() == [True, False]


def test_token_clip_loss_by_hand():
    logp_old = jnp.zeros((3, 1))
    logp = jnp.log(jnp.array([[1.5], [1.5], [4.0]]))
    adv = jnp.array([1.0, -1.0, -1.0])
    mask = jnp.ones((3, 1))
    loss, aux = G.token_clip_loss(logp, logp_old, adv, mask, 0.2, 0.28)
    # A>0: max(-1.5, -1.28) = -1.28 (clip-higher at 1.28); A<0: max(1.5, 1.28) = 1.5; 4 -> 4
    np.testing.assert_allclose(loss[:, 0], [-1.28, 1.5, 4.0], rtol=1e-6)
    assert float(aux["clip_fraction"]) == pytest.approx(1 / 3)
    dual, _ = G.token_clip_loss(logp, logp_old, adv, mask, 0.2, 0.28, dual_clip=3.0)
    np.testing.assert_allclose(dual[:, 0], [-1.28, 1.5, 3.0], rtol=1e-6)


def test_gspo_sequence_ratio_by_hand():
    logp_old = jnp.zeros((1, 3))
    logp = jnp.array([[math.log(2.0), 0.0, 5.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])  # the third token is padding
    loss, _ = G.gspo_loss(logp, logp_old, jnp.array([1.0]), mask, 3e-4, 4e-4)
    # s = exp((log 2 + 0) / 2) = sqrt(2), clipped to 1.0004: max(-1.414, -1.0004)
    np.testing.assert_allclose(loss, [[-1.0004] * 3], rtol=1e-6)
    loss, _ = G.gspo_loss(logp * 0 + 1e-4, logp_old, jnp.array([1.0]), mask, 3e-4, 4e-4)
    np.testing.assert_allclose(loss, [[-math.exp(1e-4)] * 3], rtol=1e-6)  # inside the range


def test_gspo_equals_grpo_for_one_token_completions():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(size=(6, 1)) * 0.3)
    logp_old = jnp.asarray(rng.normal(size=(6, 1)) * 0.3)
    adv = jnp.asarray(rng.normal(size=6))
    mask = jnp.ones((6, 1))
    a, _ = G.token_clip_loss(logp, logp_old, adv, mask, 0.2, 0.2)
    b, _ = G.gspo_loss(logp, logp_old, adv, mask, 0.2, 0.2)
    c, _ = G.gspo_token_loss(logp, logp_old, adv, mask, 0.2, 0.2)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6)


def test_aggregations_by_hand():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert [float(x) for x in G.token_mean(loss, mask)] == [10.0, 4.0]
    assert [float(x) for x in G.seq_mean_token_mean(loss, mask)] == [6.0, 2.0]
    assert [float(x) for x in G.seq_mean_token_sum(loss, mask)] == [10.0, 2.0]
    assert [float(x) for x in G.seq_mean_token_sum_norm(loss, mask, 5.0)] == [2.0, 2.0]


def test_kl_estimators_by_hand():
    logp, ref = jnp.log(0.5), jnp.log(0.25)
    assert float(G.kl_k1(logp, ref)) == pytest.approx(math.log(2))
    assert float(G.kl_k2(logp, ref)) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(G.kl_k3(logp, ref)) == pytest.approx(0.5 + math.log(2) - 1)


def test_truncated_is_and_mismatch():
    old = jnp.log(jnp.array([[0.3, 0.6]]))
    roll = jnp.log(jnp.array([[0.1, 0.6]]))
    mask = jnp.ones((1, 2))
    np.testing.assert_allclose(G.truncated_is_weights(old, roll, mask, "token", 2.0), [[2.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(G.truncated_is_weights(old, roll, mask, "sequence", 10.0), [[3.0, 3.0]], rtol=1e-5)
    m = G.mismatch_metrics(np.asarray(old), np.asarray(roll), np.asarray(mask))
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(math.log(3), rel=1e-5)
    assert m["mismatch/mean_abs_logp_diff"] == pytest.approx(math.log(3) / 2, rel=1e-5)
