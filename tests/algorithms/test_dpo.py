"""Preference optimisation: the losses against TRL's own loss code on the same log-probs, the
pair log-probs of a packed row against each sequence scored alone, the preference data format,
and the reference log-probs by their three routes."""

from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from posttrain.algorithms import dpo
from posttrain.config import DataSection, DPOSection
from posttrain.data.dataset import Encoder, PackedBatches
from posttrain.data.packing import pack_rows
from posttrain.errors import UserError
from posttrain.models import build_model
from posttrain.train.step import token_logprobs
from tests.helpers import with_lora
from tests.models.test_sharding_remat import CFG

B, T = 5, 12  # pairs, positions of each (padded) sequence as TRL lays them out


def trl_inputs(seed: int = 0):
    """Per-token log-probs (zero off the completion) and the completion mask of B chosen then B
    rejected sequences, TRL's layout, plus reference sums."""
    rng = np.random.default_rng(seed)
    cmask = np.zeros((2 * B, T), np.float32)
    for i in range(2 * B):
        start, end = rng.integers(2, 5), rng.integers(6, T + 1)
        cmask[i, start:end] = 1.0
    lp = -rng.gamma(2.0, 0.6, size=(2 * B, T - 1)).astype(np.float32) * cmask[:, 1:]
    ref = lp.sum(1) + rng.normal(0.0, 0.7, size=2 * B).astype(np.float32)
    return lp, cmask, ref[:B], ref[B:]


def ours(loss: str, lp, cmask, ref_c, ref_r, **kw):
    """Our batch loss (the mean over pairs, ORPO's NLL added) and its gradient w.r.t. lp."""
    m = jnp.asarray(cmask[:, 1:])

    def f(lp):
        s, n = (lp * m).sum(1), m.sum(1)
        per = dpo.preference_losses(loss, s[:B], s[B:], n[:B], n[B:], ref_c, ref_r, **kw)
        total = per["loss"].mean()
        if loss == "orpo":
            total = total - (lp[:B] * m[:B]).sum() / m[:B].sum()
        return total, per

    (value, per), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    return float(value), np.asarray(grad), per


def trl_dpo(loss: str, lp, cmask, ref_c, ref_r, beta: float, label_smoothing: float):
    """TRL's `DPOTrainer._compute_loss` itself, its model replaced by the given log-probs."""
    from trl import DPOTrainer

    lp_t = torch.tensor(lp, requires_grad=True)
    zeros = torch.zeros_like(lp_t)
    model = lambda **kw: SimpleNamespace(log_probs=lp_t, entropy=zeros, mean_logits=zeros,  # noqa: E731
                                          is_top1=zeros.bool())
    gather = lambda x: x  # noqa: E731
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, beta=beta,
        label_smoothing=label_smoothing, loss_types=[loss], loss_weights=[1.0], ld_alpha=None,
        f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0, precompute_ref_logps=True,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
        accelerator=SimpleNamespace(device="cpu", gather=gather, gather_for_metrics=gather))
    inputs = {"input_ids": torch.zeros((2 * B, T), dtype=torch.long),
              "attention_mask": torch.ones((2 * B, T), dtype=torch.long),
              "completion_mask": torch.tensor(cmask).long(),
              "ref_chosen_logps": torch.tensor(ref_c), "ref_rejected_logps": torch.tensor(ref_r)}
    value = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    value.backward()
    return value.item(), lp_t.grad.numpy(), trainer._metrics["train"]


@pytest.mark.parametrize("loss,smoothing", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0),
                                            ("robust", 0.2)])
def test_dpo_losses_equal_trls(loss, smoothing):
    lp, cmask, ref_c, ref_r = trl_inputs()
    want, want_grad, metrics = trl_dpo(loss, lp, cmask, ref_c, ref_r, 0.3, smoothing)
    got, grad, per = ours(loss, lp, cmask, ref_c, ref_r, beta=0.3, label_smoothing=smoothing)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # (TRL's model zeroes the log-probs off the completion; the stand-in here does not, so only
    # the completion positions' gradients are TRL's)
    np.testing.assert_allclose(grad, want_grad * cmask[:, 1:], rtol=1e-5, atol=1e-7)
    r_c, r_r = np.asarray(per["reward_chosen"]), np.asarray(per["reward_rejected"])
    np.testing.assert_allclose(r_c.mean(), metrics["rewards/chosen"][0], rtol=1e-5)
    np.testing.assert_allclose((r_c - r_r).mean(), metrics["rewards/margins"][0], rtol=1e-5)
    assert (r_c > r_r).mean() == pytest.approx(metrics["rewards/accuracies"][0])


def test_label_smoothed_sigmoid_is_cdpo():
    """TRL's DPO sigmoid dropped label smoothing; ours keeps the conservative-DPO form, which
    TRL's CPO trainer still computes (its logits are the caller's difference)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    lp, cmask, ref_c, ref_r = trl_inputs(1)
    got, _, _ = ours("sigmoid", lp, cmask, ref_c, ref_r, beta=0.3, label_smoothing=0.1)
    s = (lp * cmask[:, 1:]).sum(1)
    fake = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=0.3, label_smoothing=0.1,
                           accelerator=SimpleNamespace(device="cpu"))
    losses, _, _ = CPOTrainer.cpo_loss(fake, torch.tensor(s[:B] - ref_c), torch.tensor(s[B:] - ref_r))
    np.testing.assert_allclose(got, float(losses.mean()), rtol=1e-6)


def test_simpo_and_orpo_equal_trls():
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    lp, cmask, _, _ = trl_inputs(2)
    for loss in ("simpo", "orpo"):
        got, grad, per = ours(loss, lp, cmask, None, None, beta=0.25, label_smoothing=0.05,
                              simpo_gamma=0.4)
        lp_t = torch.tensor(lp, requires_grad=True)
        m = torch.tensor(cmask[:, 1:])
        avg = (lp_t * m).sum(1) / m.sum(1)  # both trainers score length-normalised log-probs
        fake = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=0.25, label_smoothing=0.05,
                               simpo_gamma=0.4, accelerator=SimpleNamespace(device="cpu"))
        if loss == "simpo":
            losses, r_c, r_r = CPOTrainer.cpo_loss(fake, avg[:B], avg[B:])
            want = losses.mean()  # cpo_alpha = 0: SimPO has no NLL term
        else:
            losses, r_c, r_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(fake, avg[:B], avg[B:])
            nll = -(lp_t[:B] * m[:B]).sum() / m[:B].sum()
            want = nll - losses.mean()
            np.testing.assert_allclose(np.asarray(per["log_odds"]).mean(), log_odds.item(), rtol=1e-5)
        want.backward()
        np.testing.assert_allclose(got, want.item(), rtol=1e-6)
        np.testing.assert_allclose(grad, lp_t.grad.numpy() * cmask[:, 1:], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(per["reward_chosen"]), r_c.numpy(), rtol=1e-6)


def pair_batch(seed: int = 0, rows: int = 3, seq_len: int = 40, pack: bool = True):
    """Random preference pairs packed into rows, and the pairs themselves."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(5):
        prompt = rng.integers(1, CFG.vocab_size, rng.integers(2, 6)).tolist()
        seqs = []
        for _ in range(2):
            comp = rng.integers(1, CFG.vocab_size, rng.integers(1, 6)).tolist()
            seqs.append((prompt + comp, [0] * len(prompt) + [1] * len(comp)))
        pairs.append(seqs)
    batch, used = pack_rows(pairs, rows, seq_len, pack=pack)
    return {k: jnp.asarray(v) for k, v in batch.items()}, pairs[:used], np.asarray(batch["group_index"])


def alone(model, ids: list[int], mask: list[int]) -> tuple[float, int]:
    """A sequence scored by itself: sum of its completion tokens' log-probs, their count."""
    x = jnp.asarray([ids])
    logits = model(x, jnp.arange(len(ids))[None], jnp.ones_like(x))
    lp = np.asarray(token_logprobs(logits[:, :-1], x[:, 1:]))[0]
    m = np.asarray(mask[1:], np.float32)
    return float((lp * m).sum()), int(m.sum())


def test_pair_logps_of_packed_rows_equal_each_sequence_alone():
    model = build_model(CFG.model_copy(update={"head_chunk_tokens": 8}))  # the head in chunks
    batch, pairs, gi = pair_batch()
    out = jax.jit(lambda b: dpo.pair_logps(model, b))(batch)
    assert (gi >= 0).sum() == len(pairs) and (gi >= 0).sum(1).max() > 1  # rows hold several
    for r, k in zip(*np.nonzero(gi >= 0)):
        (c_ids, c_mask), (r_ids, r_mask) = pairs[gi[r, k]]
        for key, (ids, mask) in (("chosen", (c_ids, c_mask)), ("rejected", (r_ids, r_mask))):
            s, n = alone(model, ids, mask)
            np.testing.assert_allclose(float(out[key][r, k]), s, rtol=1e-5, atol=1e-5)
            assert float(out[f"n_{key}"][r, k]) == n
    empty = gi < 0
    assert not np.asarray(out["n_chosen"])[empty].any() and not np.asarray(out["n_rejected"])[empty].any()


def test_the_loss_of_a_packed_batch_is_the_mean_over_its_pairs():
    model = build_model(CFG)
    batch, pairs, gi = pair_batch(1, pack=False, rows=5)
    ref = {"ref_chosen": jnp.zeros(gi.shape), "ref_rejected": jnp.zeros(gi.shape)}
    s, n, aux = dpo.make_loss_fn(DPOSection(beta=0.5))(model, {**batch, **ref})
    want = []
    for (c_ids, c_mask), (r_ids, r_mask) in pairs:
        d = alone(model, c_ids, c_mask)[0] - alone(model, r_ids, r_mask)[0]
        want.append(-jax.nn.log_sigmoid(0.5 * d))
    assert int(n) == len(pairs) == int(aux["pairs"])
    np.testing.assert_allclose(float(s) / float(n), np.mean(want), rtol=1e-5)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe

    return train_bpe(generated.corpus_for_tokenizer(9), 300, tmp_path_factory.mktemp("tok"))


def test_preference_rows_encode_both_formats_with_completion_masks(tok):
    enc = Encoder(tok, DataSection(format="preference", seq_len=128), "p.jsonl")
    (c_ids, c_mask), (r_ids, r_mask) = enc({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, 0)
    p = tok("1+2=", add_special_tokens=False)["input_ids"]
    assert c_ids == p + tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert c_mask == [0] * len(p) + [1] * (len(c_ids) - len(p)) and r_ids[:len(p)] == p
    conv = {"prompt": [{"role": "user", "content": "1+2?"}],
            "chosen": [{"role": "assistant", "content": "3"}],
            "rejected": [{"role": "assistant", "content": "4"}]}
    (c_ids, c_mask), (r_ids, r_mask) = enc(conv, 1)
    prompt = tok.apply_chat_template(conv["prompt"], tokenize=False, add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    assert c_ids[:len(p)] == p == r_ids[:len(p)] and c_mask.index(1) == len(p)
    assert tok.decode(c_ids[len(p):]).startswith("3") and tok.decode(r_ids[len(p):]).startswith("4")
    assert c_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the turn's end is trained on


@pytest.mark.parametrize("row,why", [
    ({"prompt": "a", "chosen": "b"}, "needs 'prompt', 'chosen' and 'rejected'"),
    ({"prompt": " ", "chosen": "b", "rejected": "c"}, "empty 'prompt'"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "empty 'chosen'"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
     "'chosen' is a message list but 'prompt' is a string"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "chosen": "b", "rejected": "c"}, "'prompt' ends with an assistant message"),
])
def test_bad_preference_rows_are_named(tok, row, why):
    enc = Encoder(tok, DataSection(format="preference", seq_len=64), "p.jsonl")
    with pytest.raises(UserError, match="p.jsonl: row 3") as e:
        enc(row, 3)
    assert why in str(e.value)


def test_a_pair_never_splits_and_too_long_pairs_truncate_or_drop(tok):
    rows = [{"prompt": "1+2=", "chosen": "3" * k, "rejected": "4"} for k in (1, 30, 2)]
    for truncation, first in (("right", [0, 1, 2]), ("drop", [0, 2])):
        data = DataSection(format="preference", seq_len=24, truncation=truncation)
        it = PackedBatches(rows, Encoder(tok, data, "p"), 3, 24, seed=0, shuffle=False)
        batch, ids = it.next_batch()
        assert ids[:len(first)] == first and (it.skipped > 0) == (truncation == "drop")
        slots = batch["pair_rows"] >= 0
        assert sorted(batch["pair_rows"][slots].tolist()) == sorted(ids)
        for r in range(3):  # chosen then rejected: segments 2k+1, 2k+2 of one row, in pairs
            assert batch["segment_ids"][r].max() == 2 * slots[r].sum()


def test_reference_routes_agree_and_adapters_off_is_the_base_model(tmp_path):
    """A trained LoRA policy: its reference by a frozen copy of the starting weights, by its
    own adapters switched off, by the precompute pass, and by a separate base model agree."""
    from posttrain.train.loop import reference_table, with_reference

    cfg = CFG.model_copy(update={"scan_layers": False})  # (LoRA over unrolled layers)
    base = build_model(cfg)
    policy = with_lora(build_model(cfg))  # non-zero adapters: the policy is not the base
    graphdef, params, frozen = nnx.split(policy, nnx.LoRAParam, ...)
    ref_fn = jax.jit(dpo.make_reference_fn(graphdef))
    batch, _, gi = pair_batch(3)
    off = ref_fn(jax.tree.map(jnp.zeros_like, params), frozen, batch)
    b_graph, b_params = nnx.split(base, nnx.Param)
    separate = jax.jit(dpo.make_reference_fn(b_graph))(b_params, nnx.State({}), batch)
    trained = ref_fn(params, frozen, batch)
    ok = gi >= 0
    for k in ("ref_chosen", "ref_rejected"):
        np.testing.assert_allclose(np.asarray(off[k])[ok], np.asarray(separate[k])[ok], atol=1e-5)
        assert np.abs(np.asarray(trained[k])[ok] - np.asarray(off[k])[ok]).max() > 1e-3

    class Scorer:  # the trainer's precompute interface over the separate base model
        def reference_logps(self, b):
            dev = {k: jnp.asarray(v) for k, v in b.items() if k != "pair_rows"}
            return jax.device_get(ref_fn(jax.tree.map(jnp.zeros_like, params), frozen, dev))

    _, pairs, _ = pair_batch(3)
    rows = [{"i": i} for i in range(len(pairs))]

    class PairsEncoder:  # the rows' pairs as the encoder gives them
        data = DataSection(format="preference", seq_len=40)
        source = "pairs"

        def __call__(self, row, idx):
            return pairs[row["i"]]

    from posttrain.config import RunConfig

    cfg = RunConfig(algorithm="dpo", data={"format": "preference", "seq_len": 40, "source": "x"},
                    train={"batch_size": 2})
    table = reference_table(cfg, tmp_path, Scorer(), rows, PairsEncoder())
    assert (tmp_path / "reference_logps.npz").exists()
    got = with_reference({**jax.device_get(batch), "pair_rows": gi}, table)
    for k in ("ref_chosen", "ref_rejected"):
        np.testing.assert_allclose(got[k][ok], np.asarray(separate[k])[ok], atol=1e-5)
    with pytest.raises(RuntimeError, match="no precomputed reference"):
        with_reference({"pair_rows": np.asarray([[7]])}, {k: np.full(8, np.nan) for k in table})
