"""The GRPO loss as the trainer runs it: its on-policy gradient is REINFORCE with a group
baseline (checked against torch autograd on the same weights), and gradient accumulation gives
the full-batch update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from posttrain.models.hf import nnx_to_hf
from posttrain.algorithms.grpo import grpo_advantages
from posttrain.config import RunConfig
from posttrain.models import from_pretrained
from posttrain.rollouts import build_batch
from posttrain.algorithms.grpo import make_logprob_fn, make_loss_fn
from posttrain.train.step import TrainState, make_train_step
from rollout.engine import Rollout
from tests.helpers import save_tiny_hf_model

G_SIZE = 4


def make_rollouts(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in range(2):
        prompt = rng.integers(3, 256, 4 + p).tolist()
        for _ in range(G_SIZE):
            comp = rng.integers(3, 256, int(rng.integers(2, 7))).tolist()
            out.append(Rollout(p, prompt, comp, [0.0] * len(comp), "", "length", 0))
    return out


def setup(tmp_path, **grpo):
    ref = save_tiny_hf_model(tmp_path, "qwen3")
    model = from_pretrained(tmp_path)
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {"group_size": G_SIZE, **grpo},
                                    "rewards": {"functions": [{"fn": "exact_match"}]}})
    rollouts = make_rollouts()
    rewards = np.array([1, 0, 0, 1, 0, 0, 0, 1], float)
    batch = build_batch(rollouts, grpo_advantages(rewards, G_SIZE), 16)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    dev = {k: jnp.asarray(v) for k, v in batch.items()}
    dev["logp_old"] = make_logprob_fn(graphdef, cfg.grpo)(params, rest, dev)
    dev["logp_rollout"] = dev["logp_old"]  # on-policy: no engine mismatch
    return ref, model, cfg, rollouts, rewards, graphdef, params, rest, dev


def test_on_policy_gradient_is_reinforce_with_group_baseline(tmp_path):
    ref, model, cfg, rollouts, rewards, graphdef, params, rest, dev = setup(tmp_path)
    loss_fn = make_loss_fn(cfg)

    def f(p):
        s, n, _ = loss_fn(nnx.merge(graphdef, p, rest), dev)
        return s / n

    ours = jax.grad(f)(params)
    ours_hf = dict(nnx_to_hf(model.cfg, {tuple(k): np.asarray(v[...]) for k, v in nnx.to_flat_state(ours)}))

    # REINFORCE, written independently in torch: -(1/N_tokens) sum_i A_i sum_t grad log p(y_it)
    adv = (rewards.reshape(-1, G_SIZE) - rewards.reshape(-1, G_SIZE).mean(1, keepdims=True))
    adv = (adv / (rewards.reshape(-1, G_SIZE).std(1, keepdims=True) + 1e-6)).reshape(-1)
    ref.zero_grad()
    n_tokens = sum(len(r.token_ids) for r in rollouts)
    total = 0.0
    for a, r in zip(adv, rollouts):
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        logp = torch.log_softmax(ref(input_ids=ids).logits[0, :-1].double(), -1)
        tok_lp = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(r.prompt_token_ids) - 1:]
        total = total - a * tok_lp.sum()
    (total / n_tokens).backward()
    for name, p in ref.named_parameters():
        want = p.grad.numpy()
        got = ours_hf[name]
        # fp32 vs torch (fp64 softmax): relative to the gradient's scale
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want) + 1e-7, name


def test_token_mean_accumulation_equals_full_batch(tmp_path):
    _, model, cfg, _, _, graphdef, params, rest, dev = setup(tmp_path, aggregation="token_mean")
    outs = []
    for accum in (1, 4):
        opt = optax.sgd(1.0)
        st = TrainState(jax.tree.map(jnp.copy, params), rest, opt.init(params),
                        jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
        st, m = jax.jit(make_train_step(graphdef, opt, make_loss_fn(cfg), accum))(st, dev)
        outs.append((st.params, float(m["loss"])))
    assert abs(outs[0][1] - outs[1][1]) <= 1e-6 * max(1.0, abs(outs[0][1]))
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_fused_logprob_pass_gives_the_same_update(tmp_path):
    """mu = 1, one mini-batch: without `logp_old` the loss takes pi_old = stop_gradient(pi) in
    its own forward. Same loss and gradient as the separate log-prob pass, and the per-row
    log-probs it returns (for the mismatch metrics) are that pass's."""
    _, _, cfg, _, _, graphdef, params, rest, dev = setup(tmp_path)
    loss_fn = make_loss_fn(cfg)
    fused = {k: v for k, v in dev.items() if k != "logp_old"}

    def f(p, batch):
        s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), batch)
        return s / n, aux

    (l_sep, _), g_sep = jax.value_and_grad(f, has_aux=True)(params, dev)
    (l_fused, aux), g_fused = jax.value_and_grad(f, has_aux=True)(params, fused)
    assert abs(float(l_sep) - float(l_fused)) <= 1e-6
    for a, b in zip(jax.tree.leaves(g_sep), jax.tree.leaves(g_fused)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(aux["rows/logp"]), np.asarray(dev["logp_old"]), atol=1e-5)
    # and through the jitted train step with accumulation, rows come back in batch order
    opt = optax.sgd(0.0)
    st = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                    jax.random.key_data(jax.random.key(0)))
    _, m = jax.jit(make_train_step(graphdef, opt, loss_fn, 4))(st, fused)
    np.testing.assert_allclose(np.asarray(m["rows/logp"]), np.asarray(dev["logp_old"]), atol=1e-5)


def test_the_engines_logprobs_as_pi_old_are_the_ratios_denominator(tmp_path):
    """`grpo.logp_old: rollout`: no pi_old pass; the loss takes the engine's log-probs
    (`logp_rollout`) as pi_old, so it equals the loss given them as `logp_old` (value and
    gradient), differs from the trainer's pi_old when the two differ (the ratio moves), and
    returns the trainer's own log-probs per row for the mismatch metrics."""
    _, _, cfg, _, _, graphdef, params, rest, dev = setup(tmp_path, logp_old="rollout",
                                                        mini_batches=2)
    assert not cfg.grpo.scores_old  # the trainer skips its pass
    loss_fn = make_loss_fn(cfg)
    mask = dev["loss_mask"]
    shifted = dev["logp_old"] - 0.3 * mask  # an engine that saw the tokens as less likely
    bypass = {k: v for k, v in dev.items() if k != "logp_old"} | {"logp_rollout": shifted}
    given = dict(bypass, logp_old=shifted)

    def f(p, batch):
        s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), batch)
        return s / n, aux

    (l_bypass, aux), g_bypass = jax.value_and_grad(f, has_aux=True)(params, bypass)
    (l_given, _), g_given = jax.value_and_grad(f, has_aux=True)(params, given)
    (l_trainer, _), _ = jax.value_and_grad(f, has_aux=True)(params, dict(dev, logp_rollout=shifted))
    assert abs(float(l_bypass) - float(l_given)) <= 1e-6
    for a, b in zip(jax.tree.leaves(g_bypass), jax.tree.leaves(g_given)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    assert abs(float(l_bypass) - float(l_trainer)) > 1e-3  # the ratio exp(0.3) against 1
    np.testing.assert_allclose(np.asarray(aux["rows/logp"]), np.asarray(dev["logp_old"]), atol=1e-5)
