"""A GRPO batch may pack several completions to a row (`build_batch(..., row_unit=...)`): the
loss, its gradients, the log-probs and the metrics of every loss and aggregation must be those of
the padded layout, one completion per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.grpo import grpo_advantages, make_loss_fn
from posttrain.config import RunConfig
from posttrain.models import from_pretrained
from posttrain.data.packing import packed_rows
from posttrain.rollouts import build_batch
from rollout.engine import Rollout
from tests.helpers import save_tiny_hf_model

G = 4


def rollouts(comp_lens, prompt_lens=(11, 13, 10, 14), seed=0):
    """len(prompt_lens) groups of G; completion i has comp_lens[i] tokens and random rollout
    log-probs (they stand in for the old policy's and the engine's below)."""
    rng = np.random.default_rng(seed)
    out = []
    for p, n in enumerate(prompt_lens):
        prompt = rng.integers(3, 256, n).tolist()
        for j in range(G):
            k = comp_lens[p * G + j]
            comp = rng.integers(3, 256, k).tolist()
            out.append(Rollout(p, prompt, comp, rng.uniform(-0.5, 0.5, k).tolist(), "", "stop", 0))
    return out


MIXED = [3, 5, 40, 2, 7, 4, 3, 30, 6, 2, 5, 9, 4, 35, 3, 8]  # mostly short, a few long


def test_first_fit_decreasing_fills_rows_and_the_row_count_is_bucketed():
    assert packed_rows([5, 3, 4, 2], 8, 1) == [[0, 1], [2, 3]]
    assert sorted(i for r in packed_rows(MIXED, 64, 1) for i in r) == list(range(len(MIXED)))
    lens = [10] * 16
    rows = packed_rows(lens, 64, 1)  # 3 rows of 6 -> rounded up to the bucket of 16 / 8 = 2
    assert len(rows) == 4 and sum(map(len, rows)) == 16
    assert len(packed_rows(lens, 64, 4)) % 4 == 0  # a multiple of the row unit
    assert len(packed_rows([60] * 16, 64, 1)) == 16  # one a row (build_batch keeps it padded)


def test_the_packed_batch_holds_every_completion_once_within_its_segment():
    rs = rollouts(MIXED)
    adv = np.arange(len(rs), dtype=np.float32)
    plain, packed = build_batch(rs, adv, 128, G), build_batch(rs, adv, 128, G, row_unit=1)
    assert packed["advantages"].ndim == 2 and len(packed["tokens"]) < len(plain["tokens"])
    assert "shared_prefix" not in packed
    for i, r in enumerate(rs):  # sequence i: its segment in some row, with its advantage
        ids = r.prompt_token_ids + r.token_ids
        hits = [(row, s) for row in range(len(packed["tokens"]))
                for s in range(1, packed["segment_ids"][row].max() + 1)
                if packed["tokens"][row][packed["segment_ids"][row] == s].tolist() == ids
                and packed["advantages"][row][packed["segment_ids"][row] == s][0] == adv[i]]
        assert len(hits) == 1, i
        row, s = hits[0]
        sel = packed["segment_ids"][row] == s
        np.testing.assert_array_equal(packed["positions"][row][sel], np.arange(len(ids)))
        np.testing.assert_allclose(packed["logp_rollout"][row][sel], plain["logp_rollout"][i][:len(ids)])
        np.testing.assert_array_equal(packed["loss_mask"][row][sel], plain["loss_mask"][i][:len(ids)])
    # Long completions everywhere: packing saves nothing, the padded rows (and prefix) stay.
    long = build_batch(rollouts([40] * 16, (20, 20, 20, 20)), adv, 128, G, row_unit=1)
    assert long["advantages"].ndim == 1 and "shared_prefix" in long


CASES = {
    "token_clip": {"loss": "token_clip"},
    "dual_clip+kl": {"loss": "token_clip", "dual_clip": 3.0, "beta": 0.1},
    "gspo+seq_mean_token_mean": {"loss": "gspo", "clip_low": 0.05, "clip_high": 0.05,
                                 "aggregation": "seq_mean_token_mean"},
    "gspo_token+drgrpo_norm+tis_seq": {"loss": "gspo_token", "clip_low": 0.05, "clip_high": 0.05,
                                       "aggregation": "seq_mean_token_sum_norm",
                                       "tis": {"level": "sequence", "cap": 2.0}},
    "seq_mean_token_sum+tis_token": {"aggregation": "seq_mean_token_sum",
                                     "tis": {"level": "token", "cap": 1.5}},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_model(d, "qwen3")
    return from_pretrained(d, scan_layers=False)


@pytest.mark.parametrize("case", CASES)
def test_packed_batch_gives_the_padded_loss_gradients_logprobs_and_metrics(tiny, case):
    cfg = RunConfig.model_validate({"algorithm": "grpo", "grpo": {"group_size": G, **CASES[case]},
                                    "rewards": {"functions": [{"fn": "exact_match"}]}})
    rs = rollouts(MIXED)
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0], float)
    adv = grpo_advantages(rewards, G)
    # "window": the head on the 40 positions that hold each row's completion (`head_index`),
    # over the padded rows; "fixed" likewise over rows of seq_len (the TPU's layout)
    layouts = {"padded": dict(row_unit=0), "packed": dict(row_unit=1),
               "window": dict(row_unit=0, head_window=40),
               "fixed": dict(row_unit=1, fixed=True, head_window=40)}
    batches = {name: {k: jnp.asarray(v) for k, v in build_batch(rs, adv, 128, G, **kw).items()}
               for name, kw in layouts.items()}
    assert batches["packed"]["advantages"].ndim == 2 and "head_index" not in batches["packed"]
    # fixed shapes (`grpo.shapes: fixed`): every row padded to seq_len, no packing, no prefix
    assert batches["fixed"]["tokens"].shape == (len(rs), 128) and "shared_prefix" not in batches["fixed"]
    assert batches["padded"]["tokens"].shape[1] < 128 and "head_index" not in batches["padded"]
    assert batches["window"]["head_index"].shape == (len(rs), 40)
    graphdef, params, rest = nnx.split(tiny, nnx.Param, ...)
    loss_fn = make_loss_fn(cfg)

    def f(p, b):
        s, n, aux = loss_fn(nnx.merge(graphdef, p, rest), b)
        return s / n, aux

    out = {}
    for name, b in batches.items():
        # pi_old and pi_ref off the current policy (the rollout log-probs as the offset), so
        # that ratios clip and the KL is not zero: the same per token in either layout.
        logp = f(params, {**b, "logp_ref": b["logp_rollout"]})[1]["rows/logp"]
        b = {**b, "logp_old": logp + b["logp_rollout"], "logp_ref": logp - 0.5 * b["logp_rollout"]}
        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params, b)
        out[name] = loss, aux, grads
    l_pad, a_pad, g_pad = out["padded"]
    assert float(a_pad["clip_fraction"]) > 0  # the case exercises clipping
    for name in ("packed", "window", "fixed"):
        l_x, a_x, g_x = out[name]
        # fp32, the same arithmetic in other shapes and orders (reduction order): ~1e-7 per op.
        np.testing.assert_allclose(float(l_x), float(l_pad), rtol=1e-5, err_msg=name)
        for k in a_pad:
            np.testing.assert_allclose(float(a_x[k]), float(a_pad[k]), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {k}")
        for (path, a), (_, b) in zip(nnx.to_flat_state(g_x), nnx.to_flat_state(g_pad)):
            a, b = np.asarray(a[...]), np.asarray(b[...])
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-8, (name, path)


def test_the_head_window_covers_every_loss_position_or_is_left_out():
    from posttrain.rollouts import head_index

    rs = rollouts(MIXED)
    adv = np.ones(len(rs), np.float32)
    b = build_batch(rs, adv, 128, G, fixed=True, head_window=40)
    idx, mask = b["head_index"], b["loss_mask"]
    assert idx.shape == (len(rs), 40) and (np.diff(idx, axis=1) == 1).all() and idx.max() < 128
    for row in range(len(rs)):
        assert set(np.flatnonzero(mask[row])) <= set(idx[row]), row
    # a completion longer than the window: no window (the whole row's head), nothing lost
    assert "head_index" not in build_batch(rs, adv, 128, G, fixed=True, head_window=32)
    # a window that would run past the row's end starts early enough to fit
    m = np.zeros((2, 10)); m[0, 8:] = 1; m[1, :2] = 1
    np.testing.assert_array_equal(head_index(m, 4), [[6, 7, 8, 9], [0, 1, 2, 3]])
    assert head_index(m, 1) is None


def test_completion_tokens_past_seq_len_are_reported_not_silently_dropped():
    """`build_batch` cuts each row at seq_len: the completion tokens past it get no loss. The
    step's metrics say what share that is (and the run warns), so a too-short data.seq_len
    shows instead of looking like a slow learner."""
    from posttrain.pipeline import step_metrics

    rs = rollouts(MIXED)  # prompts of 10-14 tokens, completions of 2-40
    adv, rewards = np.ones(len(rs), np.float32), np.ones(len(rs))
    total = sum(MIXED)
    for seq_len in (64, 40, 30):
        trained = build_batch(rs, adv, seq_len, G, fixed=True)["loss_mask"].sum()
        m = step_metrics(rs, rewards, adv, G, 1, seq_len)
        assert m["completion_len/beyond_seq_len"] == pytest.approx((total - trained) / total)
    assert step_metrics(rs, rewards, adv, G, 1, 64)["completion_len/beyond_seq_len"] == 0
    assert step_metrics(rs, rewards, adv, G, 1, 30)["completion_len/beyond_seq_len"] > 0
