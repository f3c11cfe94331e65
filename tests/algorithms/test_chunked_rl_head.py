"""The RL losses never hold the [tokens, vocab] logits: the GRPO policy pass, the old / reference
log-prob passes, entropy and the top-k / top-p kept-set replay run the LM head over chunks of
positions (`train.step.chunked_head`), and the kept set's cut is found without sorting the
vocabulary (`grpo.kth_largest`). Each must equal the whole-head computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.grpo import (grpo_advantages, kept_set_logprobs, kth_largest,
                                       make_logprob_fn, make_loss_fn)
from posttrain.config import RunConfig
from posttrain.models import build_model, from_pretrained
from posttrain.rollouts import build_batch
from rollout.engine import Rollout
from tests.helpers import save_tiny_hf_model
from tests.models.test_sharding_remat import CFG

G = 4


def test_kth_largest_is_what_a_sort_puts_at_k():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 300)).astype(np.float32)
    x[0, :, :40] = 0.25  # ties, at and around the cut
    x[1, :, 7] = np.inf  # the forced target
    x[1, :, 8] = -np.inf
    x[2] = -np.abs(x[2])  # all negative
    x[2, :, 3] = 0.0
    k = rng.integers(1, 301, size=(3, 5))
    k[0, 0], k[1, 0], k[2, 0] = 1, 300, 39
    got = np.asarray(kth_largest(jnp.asarray(x), jnp.asarray(k)))
    want = np.take_along_axis(-np.sort(-x, axis=-1), k[..., None] - 1, axis=-1)
    np.testing.assert_array_equal(got, want)


def test_the_sort_free_cut_keeps_what_top_k_keeps():
    """Against the sort it replaces (`lax.top_k` over the vocabulary): the same kept log-probs
    and masses, exactly, on logits with ties at the cut and targets outside the top K."""
    rng = np.random.default_rng(1)
    z = jnp.asarray(np.round(rng.normal(size=(4, 16, 64)), 1), jnp.float32)  # rounded: many ties
    tg = jnp.asarray(rng.integers(0, 64, (4, 16)))
    kept = jnp.asarray(rng.integers(0, 70, (4, 16)))
    lp, lm = kept_set_logprobs(z, tg, kept, 64)

    def by_sort(z, tg, kept):  # the previous implementation, verbatim but for the cut
        v = z.shape[-1]
        is_t = jnp.arange(v) == tg[..., None]
        k = jnp.where((kept <= 0) | (kept >= v), v, kept)
        sel = jnp.where(is_t, jnp.inf, z)
        top = jax.lax.top_k(sel, v)[0]
        cut = jnp.take_along_axis(top, jnp.minimum(k, v)[..., None] - 1, axis=-1)
        above, tied = sel > cut, sel == cut
        share = jnp.clip(k[..., None] - above.sum(-1, keepdims=True), 0,
                         tied.sum(-1, keepdims=True)) / jnp.maximum(tied.sum(-1, keepdims=True), 1)
        w = jnp.where(above, 1.0, jnp.where(tied, share, 0.0))
        w = jnp.where(k[..., None] >= v, 1.0, w)
        lse_kept = jax.nn.logsumexp(z, axis=-1, b=w)
        return (jnp.take_along_axis(z, tg[..., None], -1)[..., 0] - lse_kept,
                lse_kept - jax.nn.logsumexp(z, axis=-1))

    want_lp, want_lm = by_sort(z, tg, kept)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lm), np.asarray(want_lm), atol=1e-6)


def rollouts(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p, n in enumerate((32, 37)):
        prompt = rng.integers(3, 256, n).tolist()
        for _ in range(G):
            comp = rng.integers(3, 256, int(rng.integers(4, 20))).tolist()
            kept = rng.integers(1, 300, len(comp)).tolist()
            out.append(Rollout(p, prompt, comp, [0.0] * len(comp), "", "length", 0,
                               kept_counts=kept))
    return out


@pytest.mark.parametrize("semantics,top_k,top_p,shared", [
    ("sampled", 0, 1.0, False),      # no truncation: plain log-probs
    ("sampled", 0, 0.9, True),       # top-p: an unbounded kept set, the shared-prefix pass
    ("full", 40, 1.0, False),        # top-k, the full-softmax semantics, KL to a reference
])
def test_chunked_rl_head_equals_the_whole_head(tmp_path, semantics, top_k, top_p, shared):
    """GRPO's loss, its gradients, the per-row log-probs, entropy, kept mass and the old /
    reference log-prob pass with the head in chunks of 8 positions (ragged last chunk) equal
    the whole head's; fp32, the same arithmetic in other shapes: 1e-5."""
    save_tiny_hf_model(tmp_path, "qwen3")
    beta = 0.1 if semantics == "full" else 0.0
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {
        "group_size": G, "top_k": top_k, "top_p": top_p, "logprob_semantics": semantics,
        "temperature": 0.8, "beta": beta}, "rewards": {"functions": [{"fn": "exact_match"}]}})
    rs = rollouts()
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0], float)
    batch = {k: jnp.asarray(v) for k, v in build_batch(rs, grpo_advantages(rewards, G), 64,
                                                       G if shared else 0).items()}
    assert ("shared_prefix" in batch) == shared
    b, t = batch["tokens"].shape
    if beta:
        batch["logp_ref"] = jnp.asarray(np.random.default_rng(2).normal(-3, 1, (b, t)), jnp.float32)
    out = {}
    for name, chunk in (("whole", 10**6), ("chunked", 8 * b)):
        model = from_pretrained(tmp_path, head_chunk_tokens=chunk)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss_fn = make_loss_fn(cfg)

        def f(p):
            s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), batch)
            return s / n, aux

        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
        lp = make_logprob_fn(graphdef, cfg.grpo)(params, rest, batch)
        out[name] = (loss, aux, grads, lp)
    (lw, aw, gw, pw), (lc, ac, gc, pc) = out["whole"], out["chunked"]
    np.testing.assert_allclose(float(lc), float(lw), rtol=1e-5)
    mask = np.asarray(batch["loss_mask"]) > 0
    for got, want in ((ac["rows/logp"], aw["rows/logp"]), (pc, pw)):
        np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(pc)[mask], np.asarray(ac["rows/logp"])[mask], atol=1e-5)
    for key in ("entropy", "sampling/kept_mass", "kl"):
        assert (key in ac) == (key in aw)
        if key in ac:
            np.testing.assert_allclose(float(ac[key]), float(aw[key]), rtol=1e-5, err_msg=key)
    assert ("sampling/kept_mass" in ac) == (top_k > 0 or top_p < 1)
    for (path, a), (_, w) in zip(nnx.to_flat_state(gc), nnx.to_flat_state(gw)):
        a, w = np.asarray(a[...]), np.asarray(w[...])
        assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w) + 1e-8, path


def test_the_rl_loss_never_holds_the_whole_logits():
    """No array of the GRPO loss's forward or backward, top-p replay included, has B x T x V
    elements when the head runs in chunks (a vocabulary big enough that the logits would be the
    largest array, as they are in real models)."""
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {
        "group_size": G, "top_p": 0.9}, "rewards": {"functions": [{"fn": "exact_match"}]}})
    batch = {k: jnp.asarray(v) for k, v in build_batch(
        rollouts(), grpo_advantages(np.arange(8.0), G), 64).items()}
    b, t = batch["tokens"].shape
    model = build_model(CFG.model_copy(update={"head_chunk_tokens": 8 * b, "vocab_size": 4096}))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = make_loss_fn(cfg)
    grad = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)[0])
    whole = b * t * model.cfg.vocab_size

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                yield int(np.prod(getattr(v.aval, "shape", ())))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    assert max(sizes(jax.make_jaxpr(grad)(params).jaxpr)) < whole
    # control: the whole head does hold them
    unchunked = build_model(CFG.model_copy(update={"head_chunk_tokens": 10**6, "vocab_size": 4096}))
    g2, p2, r2 = nnx.split(unchunked, nnx.Param, ...)
    grad2 = jax.grad(lambda p: loss_fn(nnx.merge(g2, p, r2), batch)[0])
    assert max(sizes(jax.make_jaxpr(grad2)(p2).jaxpr)) >= whole
