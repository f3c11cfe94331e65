"""Log-prob semantics under top-k / top-p (`grpo.logprob_semantics`): the trainer's renormalised
log-prob over the kept set the engine reports, worked by hand on small vocabularies (ties at the
cut included), and the on-policy update under `sampled` is REINFORCE on the truncated policy
(checked against torch autograd with the kept sets built independently)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from posttrain.models.hf import nnx_to_hf
from posttrain.algorithms.grpo import grpo_advantages, kept_set_logprobs, policy_logprobs
from posttrain.config import RunConfig
from posttrain.models import from_pretrained
from posttrain.rollouts import build_batch
from posttrain.algorithms.grpo import make_logprob_fn, make_loss_fn
from rollout.engine import SamplingParams
from rollout.jax_engine import JaxEngine
from tests.helpers import save_tiny_model_with_tokenizer

P = np.array([0.5, 0.25, 0.125, 0.125])  # probabilities of a 4-token vocabulary


def kept(logits, target, k, kmax=None):
    lp, log_mass = kept_set_logprobs(jnp.asarray([[logits]], jnp.float32), jnp.asarray([[target]]),
                                     jnp.asarray([[k]]), kmax or len(logits))
    return float(lp[0, 0]), float(np.exp(log_mass[0, 0]))


@pytest.mark.parametrize("target,k,want_lp,want_mass", [
    (0, 2, np.log(0.5 / 0.75), 0.75),     # top_p 0.6 keeps {0, 1}
    (1, 2, np.log(0.25 / 0.75), 0.75),
    (0, 1, 0.0, 0.5),                      # one token kept: log-prob 0
    (2, 4, np.log(0.125), 1.0),            # everything kept: the full softmax
    (3, 0, np.log(0.125), 1.0),            # 0: no truncation reported
    # a tie at the cut: tokens 2 and 3 weigh the same, an engine that keeps 3 tokens kept one
    # of them (vLLM: whichever its sort put first); the normaliser is 0.875 either way
    (2, 3, np.log(0.125 / 0.875), 0.875),
    (3, 3, np.log(0.125 / 0.875), 0.875),
    (0, 3, np.log(0.5 / 0.875), 0.875),
])
def test_renormalised_logprob_by_hand(target, k, want_lp, want_mass):
    lp, mass = kept(np.log(P), target, k)
    assert lp == pytest.approx(want_lp, abs=1e-6) and mass == pytest.approx(want_mass, abs=1e-6)


def test_tied_tokens_share_the_places_left_at_the_cut():
    # logits (1, 1, 1, 0), K = 2, target 0: the kept set is {0, 1} or {0, 2}, mass 2e of e+e+e+1
    lp, mass = kept([1.0, 1.0, 1.0, 0.0], 0, 2)
    assert lp == pytest.approx(-np.log(2), abs=1e-6)
    assert mass == pytest.approx(2 * np.e / (3 * np.e + 1), abs=1e-6)
    # K past the static bound kmax (top_k 2 but three tied, as a value cut keeps them): all three
    lp, _ = kept([1.0, 1.0, 1.0, 0.0], 1, 3, kmax=2)
    assert lp == pytest.approx(-np.log(3), abs=1e-6)


def test_sampled_token_just_outside_the_trainers_top_k_is_kept():
    """The engine kept token 3 as its 3rd (its logit was above token 2's there); the trainer's
    logits put token 2 a hair above: the set is the trainer's top 2 plus the sampled token, the
    engine's set, not the trainer's top 3 (which would drop the sampled token)."""
    z = [3.0, 2.0, 1.0, 0.9999]
    lp, mass = kept(z, 3, 3)
    e = np.exp(z)
    assert lp == pytest.approx(z[3] - np.log(e[0] + e[1] + e[3]), abs=1e-6)
    assert mass == pytest.approx((e[0] + e[1] + e[3]) / e.sum(), abs=1e-6)


def test_policy_logprobs_follow_the_semantics():
    z = jnp.log(jnp.asarray([[P, P]], jnp.float32))
    y, k = jnp.asarray([[1, 2]]), jnp.asarray([[2, 4]])
    lp, log_mass = policy_logprobs(z, y, k, "sampled", 0, 0.6)
    np.testing.assert_allclose(np.asarray(lp), [[np.log(1 / 3), np.log(0.125)]], atol=1e-6)
    lp, log_mass_f = policy_logprobs(z, y, k, "full", 0, 0.6)
    np.testing.assert_allclose(np.asarray(lp), [[np.log(0.25), np.log(0.125)]], atol=1e-6)
    np.testing.assert_allclose(np.exp(np.asarray(log_mass_f)), [[0.75, 1.0]], atol=1e-6)
    lp, log_mass = policy_logprobs(z, y, k, "sampled", 0, 1.0)  # nothing truncated
    assert log_mass is None
    np.testing.assert_allclose(np.asarray(lp), [[np.log(0.25), np.log(0.125)]], atol=1e-6)


TOP_K, TOP_P, TEMP, G_SIZE = 40, 0.6, 0.7, 4


def test_sampled_on_policy_is_reinforce_on_the_truncated_policy(tmp_path):
    ref, tok = save_tiny_model_with_tokenizer(tmp_path, "qwen3")
    model = from_pretrained(tmp_path)
    rollouts = JaxEngine(model, tok).generate(
        [[5, 17, 99, 200], [42, 43, 44]],
        SamplingParams(n=G_SIZE, temperature=TEMP, top_k=TOP_K, top_p=TOP_P, max_tokens=6, seed=3,
                       ignore_eos=True))
    ks = [k for r in rollouts for k in r.kept_counts]
    assert 1 < min(ks) and max(ks) <= TOP_K and len(set(ks)) > 1  # both cuts active, K varies
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {
        "group_size": G_SIZE, "temperature": TEMP, "top_k": TOP_K, "top_p": TOP_P},
        "rewards": {"functions": [{"fn": "exact_match"}]}})
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 1], float)
    adv = grpo_advantages(rewards, G_SIZE)
    dev = {k: jnp.asarray(v) for k, v in build_batch(rollouts, adv, 16).items()}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mask = np.asarray(dev["loss_mask"]) > 0

    # the trainer's separate old-policy pass reproduces the engine's log-probs ...
    logp_old = np.asarray(make_logprob_fn(graphdef, cfg.grpo)(params, rest, dev))
    assert np.abs(logp_old - np.asarray(dev["logp_rollout"]))[mask].max() <= 1e-4

    # ... and in the fused update (mu = 1: pi_old = stop_gradient(pi)) the ratio is exactly 1
    loss_fn = make_loss_fn(cfg)

    def f(p):
        s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), dev)
        return s / n, aux

    (loss, aux), ours = jax.value_and_grad(f, has_aux=True)(params)
    assert float(aux["clip_fraction"]) == 0.0 and 0.0 < float(aux["sampling/kept_mass"]) < 1.0
    n_tok = mask.sum()
    tis = np.minimum(np.exp(np.asarray(aux["rows/logp"]) - np.asarray(dev["logp_rollout"])), 2.0)
    # with all advantages 1 the loss is -mean(ratio * w): ratio 1 in the fused update, and within
    # fp32 noise of 1 against the separate old-policy pass (the same semantics on both sides; a
    # full-softmax pi_old would put the ratio at 1 / kept mass, ~1.5 here)
    ones = {**dev, "advantages": jnp.ones_like(dev["advantages"])}
    want = -(tis * mask).sum() / n_tok
    for batch in (ones, {**ones, "logp_old": jnp.asarray(logp_old)}):
        s, n, _ = loss_fn(model, batch)
        assert float(s / n) == pytest.approx(want, rel=1e-5)

    # REINFORCE on the truncated policy, written independently in torch: the kept set at each
    # position is the K largest logits (K from the engine), log pi^S = z_y - logsumexp_S z
    ours_hf = dict(nnx_to_hf(model.cfg, {tuple(k): np.asarray(v[...]) for k, v in nnx.to_flat_state(ours)}))
    ref.zero_grad()
    total = 0.0
    for i, (a, r) in enumerate(zip(adv, rollouts)):
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        z = ref(input_ids=ids).logits[0, :-1].double() / TEMP
        p0 = len(r.prompt_token_ids) - 1
        for t, (y, k) in enumerate(zip(r.token_ids, r.kept_counts)):
            s = torch.topk(z[p0 + t].detach(), k).indices
            assert y in s.tolist()
            w = float(tis[i, p0 + t])  # detached TIS weight (~1: engine and trainer agree)
            total = total - a * w * (z[p0 + t, y] - torch.logsumexp(z[p0 + t, s], 0))
    (total / n_tok).backward()
    for name, p in ref.named_parameters():
        want = p.grad.numpy()
        # fp32 vs torch (fp64 softmax): relative to the gradient's scale
        assert np.linalg.norm(ours_hf[name] - want) <= 1e-4 * np.linalg.norm(want) + 1e-7, name
