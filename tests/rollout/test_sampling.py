"""Sampling correctness: empirical frequencies under temperature / top-k / top-p match the
intended distribution (chi-square at a fixed seed), and a seed reproduces its samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from rollout.sampling import sample

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def intended(temperature, top_k, top_p):
    """Written independently of rollout.sampling: plain numpy, the textbook definitions."""
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    mass, kept = 0.0, np.zeros_like(keep)
    for i in order:  # smallest prefix with mass >= top_p
        if not keep[i]:
            continue
        kept[i] = True
        mass += p[i]
        if mass >= top_p - 1e-12:
            break
    p = np.where(kept, p, 0)
    return p / p.sum()


N = 40_000


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.8, 5, 0.9)])
def test_empirical_frequencies_match(temperature, top_k, top_p):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (N, len(LOGITS)))
    tok, lp, kept = jax.jit(sample)(jax.random.key(0), logits, temperature, top_k, top_p)
    want = intended(temperature, top_k, top_p)
    assert (np.asarray(kept) == (want > 0).sum()).all()  # the kept count the trainer replays
    counts = np.bincount(np.asarray(tok), minlength=len(LOGITS))
    assert counts[want == 0].sum() == 0  # nothing outside the kept set
    support = want > 0
    stat, p_value = chisquare(counts[support], N * want[support])
    assert p_value > 1e-3, (counts, N * want)
    # the reported logprob is that of the processed distribution
    np.testing.assert_allclose(np.asarray(lp), np.log(want[np.asarray(tok)]), atol=1e-5)


def test_same_seed_same_samples_and_greedy():
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (64, len(LOGITS)))
    a, _, _ = sample(jax.random.key(3), logits, 1.0, 0, 1.0)
    b, _, _ = sample(jax.random.key(3), logits, 1.0, 0, 1.0)
    c, _, _ = sample(jax.random.key(4), logits, 1.0, 0, 1.0)
    assert (np.asarray(a) == np.asarray(b)).all() and (np.asarray(a) != np.asarray(c)).any()
    g, lp, _ = sample(jax.random.key(0), logits, 0.0, 0, 1.0)
    assert (np.asarray(g) == 0).all()
    np.testing.assert_allclose(np.asarray(lp), np.log(intended(1.0, 0, 1.0)[0]), atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (3, 1.0), (5, 0.9)])
def test_full_semantics_reports_the_whole_softmax(top_k, top_p):
    """Same draws as the default; the log-prob is that of the temperature-scaled full softmax."""
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (256, len(LOGITS)))
    tok, lp, kept = sample(jax.random.key(1), logits, 0.8, top_k, top_p)
    tok_f, lp_f, kept_f = sample(jax.random.key(1), logits, 0.8, top_k, top_p, True)
    assert (np.asarray(tok) == np.asarray(tok_f)).all() and (np.asarray(kept) == np.asarray(kept_f)).all()
    full = intended(0.8, 0, 1.0)
    np.testing.assert_allclose(np.asarray(lp_f), np.log(full[np.asarray(tok)]), atol=1e-5)
    kept_mass = full[intended(0.8, top_k, top_p) > 0].sum()  # log pi^S = log pi - log pi(S)
    np.testing.assert_allclose(np.asarray(lp) - np.asarray(lp_f), -np.log(kept_mass), atol=1e-5)


def test_ties_at_the_cut_are_kept():
    """Hand-worked: logits (1, 1, 1, 0) with top_k 2 -- the three tied tokens all stay (a value
    cut), each with probability 1/3; top_p 0.5 on (0.5, 0.25, 0.125, 0.125) keeps 2 tokens."""
    x = jnp.log(jnp.asarray([[np.e, np.e, np.e, 1.0]] * 512, jnp.float32))
    tok, lp, kept = sample(jax.random.key(0), x, 1.0, 2, 1.0)
    assert (np.asarray(kept) == 3).all() and set(np.asarray(tok).tolist()) == {0, 1, 2}
    np.testing.assert_allclose(np.asarray(lp), np.log(1 / 3), atol=1e-6)
    x = jnp.log(jnp.asarray([[0.5, 0.25, 0.125, 0.125]] * 512, jnp.float32))
    tok, lp, kept = sample(jax.random.key(0), x, 1.0, 0, 0.5)
    assert (np.asarray(kept) == 1).all() and (np.asarray(lp) == 0).all()  # mass 0.5 >= 0.5
    tok, lp, kept = sample(jax.random.key(0), x, 1.0, 0, 0.6)
    assert (np.asarray(kept) == 2).all() and set(np.asarray(tok).tolist()) == {0, 1}
    np.testing.assert_allclose(np.asarray(lp), np.log(np.where(np.asarray(tok) == 0, 2 / 3, 1 / 3)),
                               atol=1e-6)
    # the tie at the cut of top_p 0.8 (0.75 before the 3rd, 0.875 before the tied 4th): both kept
    tok, lp, kept = sample(jax.random.key(0), x, 1.0, 0, 0.8)
    assert (np.asarray(kept) == 4).all()


def test_engine_seed_reproduces(tmp_path):
    from posttrain.models import ModelConfig, build_model
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine

    eng = JaxEngine(build_model(ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=1, head_dim=16)))
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=11)
    a = [r.token_ids for r in eng.generate([[1, 2, 3]], sp)]
    b = [r.token_ids for r in eng.generate([[1, 2, 3]], sp)]
    assert a == b and len({tuple(x) for x in a}) > 1  # reproducible, and the n samples differ


def test_argmax_first_is_argmax_with_its_tie_rule():
    """The first index of the maximum, as jnp.argmax: random rows, rows of ties, -inf entries."""
    from rollout.sampling import argmax_first

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 512)).astype(np.float32)
    x[1, [7, 300]] = 9.0  # a tie: the first wins
    x[2] = 0.0  # all tied
    x[3, :500] = -np.inf
    assert np.array_equal(argmax_first(jnp.asarray(x)), jnp.argmax(jnp.asarray(x), axis=-1))


def test_inverse_cdf_never_draws_a_token_without_mass():
    """A draw that rounds up to the row's total (here forced: u = 1) must not run past the last
    token with mass: with the trailing tokens impossible it lands on the last possible one."""
    from rollout import sampling

    lp = jnp.full((4, 512), -jnp.inf).at[:, :10].set(jnp.log(0.1))
    orig = jax.random.uniform
    try:
        sampling.jax.random.uniform = lambda key, shape, dtype: jnp.ones(shape, dtype)
        assert np.all(np.asarray(sampling.inverse_cdf(jax.random.key(0), lp)) == 9)
    finally:
        sampling.jax.random.uniform = orig


def test_the_two_level_search_draws_the_same_distribution():
    """A vocabulary of many blocks (here 300 tokens in blocks of 16, whole blocks without mass
    among them) drawn in two levels: frequencies match the softmax (chi-square), nothing without
    mass is drawn, and a draw forced up to the total lands on the last token with mass."""
    from rollout import sampling

    rng = np.random.default_rng(0)
    logits = rng.normal(size=300).astype(np.float32) * 2
    logits[32:80] = -np.inf  # three whole blocks and a part of another without mass
    logits[290:] = -np.inf
    want = np.exp(logits.astype(np.float64) - logits[np.isfinite(logits)].max())
    want /= want.sum()
    lp = jnp.broadcast_to(jnp.asarray(np.log(want), jnp.float32), (N, 300))
    tok = np.asarray(jax.jit(sampling.inverse_cdf, static_argnums=2)(jax.random.key(5), lp, 16))
    counts = np.bincount(tok, minlength=300)
    assert counts[want == 0].sum() == 0
    big = want * N >= 5  # chi-square over tokens expected 5+ times, the rest pooled
    stat, p_value = chisquare(np.r_[counts[big], counts[~big].sum()],
                              N * np.r_[want[big], want[~big].sum()])
    assert p_value > 1e-3
    orig = jax.random.uniform
    try:
        sampling.jax.random.uniform = lambda key, shape, dtype: jnp.ones(shape, dtype)
        assert np.all(np.asarray(sampling.inverse_cdf(jax.random.key(0), lp[:4], 16)) == 289)
    finally:
        sampling.jax.random.uniform = orig


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.9), (0, 0.3), (200, 0.95)])
def test_the_cuts_without_a_sort_keep_the_sorted_prefix(top_k, top_p):
    """Random logits over a 3,000-token vocabulary at temperature 0.7: the kept set of
    `process_logits` (value cuts found by bisection, no sort) is exactly the textbook one, the k
    largest and then the smallest prefix of the sorted tokens whose float64 mass reaches top_p
    (no cumulative sum lands within 1e-6 of top_p at this seed, so fp32 rounding cannot move the
    boundary)."""
    from rollout.sampling import NEG, process_logits

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 3000)) * 3).astype(np.float32)
    got = np.asarray(process_logits(jnp.asarray(x), 0.7, top_k, top_p) > NEG / 2)
    for row, kept in zip(x.astype(np.float64) / np.float32(0.7), got):
        order = np.argsort(-row)
        keep = order[: top_k or len(row)]
        p = np.exp(row[keep] - row[keep].max())
        cum_before = np.cumsum(p / p.sum()) - p / p.sum()
        assert np.abs(cum_before - top_p).min() > 1e-6
        want = np.zeros(len(row), bool)
        want[keep[cum_before < top_p]] = True
        assert np.array_equal(kept, want)
