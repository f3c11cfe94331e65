"""The GRPO update runs the prompt a group's rows share once per group (`shared_prefix`): the
loss, its gradients and the per-row log-probs must be the plain pass's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.grpo import grpo_advantages, make_loss_fn
from posttrain.config import RunConfig
from posttrain.models import from_pretrained
from posttrain.rollouts import build_batch, shared_prefix_len
from rollout.engine import Rollout
from tests.helpers import save_tiny_hf_model, with_lora

G = 4


def rollouts(prompt_lens=(21, 37), seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p, n in enumerate(prompt_lens):
        prompt = rng.integers(3, 256, n).tolist()
        for _ in range(G):
            comp = rng.integers(3, 256, int(rng.integers(2, 12))).tolist()
            out.append(Rollout(p, prompt, comp, [0.0] * len(comp), "", "length", 0))
    return out


def test_the_shared_prefix_is_what_every_group_shares_rounded_down():
    rs = rollouts((21, 37))
    assert shared_prefix_len(rs, G, 128) == 16  # min prompt 21 -> 16
    assert shared_prefix_len(rollouts((40, 37)), G, 128) == 32
    assert shared_prefix_len(rs, 1, 128) == 0  # one row per group: nothing shared
    assert shared_prefix_len(rollouts((9, 37)), G, 128) == 0  # under one bucket
    other = list(rs)
    other[1] = dataclasses.replace(other[1], prompt_token_ids=[5] + other[1].prompt_token_ids[1:])
    assert shared_prefix_len(other, G, 128) == 0  # a group whose prompts differ
    b = build_batch(rs, np.zeros(len(rs)), 64, G)
    assert b["shared_prefix"].shape == (2 * G, 16)
    np.testing.assert_array_equal(b["shared_prefix"], b["tokens"][:, :16])
    assert "shared_prefix" not in build_batch(rs, np.zeros(len(rs)), 64)


@pytest.mark.parametrize("scan,remat,lora,kv", [(False, "none", False, "auto"),
                                                (True, "full", False, "skbd"),
                                                (False, "none", True, "auto")])
def test_shared_prefix_pass_gives_the_plain_loss_gradients_and_logprobs(tmp_path, scan, remat,
                                                                         lora, kv):
    """With LoRA too: its adapters apply only inside the model's call (qwix intercepts
    `__call__`), which a prefix pass pieced together from other methods silently skipped. And
    over the slot-outermost cache (`kv_layout` skbd): its rows repeated on their own axis, the
    gradient through its einsums and the layout pin."""
    save_tiny_hf_model(tmp_path, "qwen3")
    model = from_pretrained(tmp_path, scan_layers=scan, remat=remat, kv_layout=kv)
    if lora:
        model = with_lora(model)
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {"group_size": G},
                                    "rewards": {"functions": [{"fn": "exact_match"}]}})
    # Group 0's prompt is exactly the shared 32 tokens: its first completion token is predicted
    # from the prefix pass; group 1's rows attend over the prefix's repeated cache.
    rs = rollouts((32, 37))
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0], float)
    # and the head on each row's completion window alone (`head_index`) over the shared pass
    batch = {k: jnp.asarray(v) for k, v in
             build_batch(rs, grpo_advantages(rewards, G), 64, G, head_window=16).items()}
    plain = {k: v for k, v in batch.items() if k not in ("shared_prefix", "head_index")}
    assert "shared_prefix" in batch and batch["head_index"].shape == (2 * G, 16)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = make_loss_fn(cfg)

    def f(p, b):
        s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), b)
        return s / n, aux["rows/logp"]

    (l_shared, lp_shared), g_shared = jax.value_and_grad(f, has_aux=True)(params, batch)
    (l_plain, lp_plain), g_plain = jax.value_and_grad(f, has_aux=True)(params, plain)
    # fp32, the same arithmetic in other shapes (reduction order): ~1e-7 relative per op. At the
    # start the ratio is 1 and the group-normalised advantages sum to zero, so the loss is the
    # residue of O(1) terms cancelling (~3e-6): its rounding error is absolute, a few f32 ulps of
    # the terms (1e-7 each), and a relative bound on the residue failed on one CPU's reduction
    # order (1.1e-5 relative, 3e-11 absolute). Log-probs and gradients below stay relative.
    np.testing.assert_allclose(float(l_shared), float(l_plain), rtol=1e-5, atol=1e-7)
    mask = np.asarray(batch["loss_mask"]) > 0
    np.testing.assert_allclose(np.asarray(lp_shared)[mask], np.asarray(lp_plain)[mask], atol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_shared), nnx.to_flat_state(g_plain)):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-8, path
    if lora:  # the adapters are in the loss on both paths (zero gradients if skipped)
        for path, var in nnx.to_flat_state(g_shared):
            if "lora" in str(path[-1]):
                assert np.abs(np.asarray(var[...])).max() > 0, path
