"""Rollout engines against transformers and the trainer: greedy ids, logprobs, weight sync.

Tolerances (fp32): JAX engine logprobs vs the trainer's <= 1e-4 (same model code; the decode path
differs only in reduction order); vLLM logprobs vs the trainer's <= 1e-3 (different kernels).
"""

import json
import subprocess
import sys
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from posttrain.models import from_pretrained
from posttrain.train.step import TrainState, make_train_step, next_token_loss, token_logprobs
from rollout.engine import SamplingParams
from rollout.jax_engine import JaxEngine
from tests.helpers import save_tiny_model_with_tokenizer

PROMPTS = [[5, 17, 99, 200, 33], [7] * 11 + [300, 301], [42, 43, 44]]


def hf_greedy(model, prompt, n=24, eos=0):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


TRUNCATIONS = [(top_p, top_k) for top_p in (1.0, 0.9, 0.5) for top_k in (0, 5, 20)]


def trainer_side(model, rollouts, sp: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trainer's log-probs of the rollouts' tokens as the GRPO update computes them (the
    batch it builds, the semantics it applies, the kept counts it replays), the engine's, and
    the completion mask."""
    from posttrain.algorithms.grpo import policy_logprobs
    from posttrain.rollouts import build_batch

    b = build_batch(rollouts, np.zeros(len(rollouts)), 256)
    logits = model(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                   jnp.asarray(b["segment_ids"])) / sp.temperature
    lp, _ = policy_logprobs(logits, jnp.asarray(b["targets"]), jnp.asarray(b["kept_counts"]),
                            sp.logprobs, sp.top_k, sp.top_p)
    return np.asarray(lp), b["logp_rollout"], b["loss_mask"] > 0


def assert_same_samples(model, a, b, sp: SamplingParams, tol: float = 1e-5):
    """Two generations of the same prompts that must draw the same tokens: equal ids and
    kept counts, log-probs within `tol`. Two exceptions, both fp32 rounding meeting a
    discontinuity of sampling, and both must come after a prefix that agrees within `tol` and
    stay rare (at most 2 outputs per comparison):
    - a sampled step where the shared uniform draw falls within fp32 rounding (~1e-6) of a
      boundary of the cumulative distribution, which inverse-CDF sampling turns into the two
      neighbouring tokens with mass: they must have no token kept between them (checked on the
      model's own logits at that step: a wrong row or key picks tokens far apart);
    - a step where the same token is drawn from kept sets of different sizes: the last token
      kept by the smaller set and the extra ones of the larger are tied within rounding (1e-6
      relative) on the model's logits, which one computation rounds to equal values (ties are
      kept together) and the other one ulp apart. Logits of a wrong row or key are not tied
      there (neighbouring sorted logits of these models lie ~1e-3 apart)."""
    from rollout.sampling import NEG, process_logits

    diverged = 0
    for i, (x, y) in enumerate(zip(a, b)):
        n = 0
        while n < min(len(x.token_ids), len(y.token_ids)) and x.token_ids[n] == y.token_ids[n]:
            n += 1
        m = next((j for j in range(n) if x.kept_counts[j] != y.kept_counts[j]), n)
        gap = np.abs(np.subtract(x.logprobs[:m], y.logprobs[:m])).max(initial=0)

        assert gap <= tol, (sp, i, gap)
        if m == n and x.token_ids == y.token_ids:
            continue
        assert sp.temperature > 0 and m < len(x.token_ids) and m < len(y.token_ids), (sp, i, m)
        diverged += 1
        ids = jnp.asarray([x.prompt_token_ids + x.token_ids[:m]])
        logits = model(ids)[:, -1]
        if m < n:  # the same token, kept sets of different sizes: a tie at the boundary
            lo, hi = sorted((x.kept_counts[m], y.kept_counts[m]))
            ranked = np.sort(np.asarray(logits[0], np.float32) / np.float32(sp.temperature))[::-1]
            assert np.allclose(ranked[lo - 1:hi], ranked[lo - 1], rtol=1e-6, atol=0), (
                sp, i, m, lo, hi, ranked[lo - 1:hi + 1])
            continue
        kept = np.asarray(process_logits(logits, sp.temperature, sp.top_k, sp.top_p) > NEG / 2)[0]
        lo, hi = sorted((x.token_ids[n], y.token_ids[n]))
        assert kept[lo] and kept[hi] and not kept[lo + 1:hi].any(), (sp, i, n, lo, hi)
    assert diverged <= 2, (sp, diverged)


# Two int8 caches filled from fp32 keys and values that differ in summation order (two layouts,
# two attention paths) can round one value of a head to neighbouring integers, where x / scale
# lies within fp32 rounding of a .5 boundary: one step of 1/127 of the head's absmax, which moves
# the next log-probs by up to the int8 cache's own rounding (measured 8e-5 on one token of 10
# outputs, AVX-512 CPU). Bounded by what an int8 cache may move the sampling path's log-probs
# (`JaxEngine.probe_tolerance`, ~5e-3 on the test models); float caches stay at 1e-5.
INT8_FLIP_TOL = 5e-3


def trainer_logprobs(model, prompt, completion, temperature=1.0):
    ids = jnp.asarray([prompt + completion])
    logits = model(ids)[:, :-1] / temperature
    lp = token_logprobs(logits, ids[:, 1:])[0]
    return np.asarray(lp[len(prompt) - 1:])


def scanned(d) -> bool:
    """The engine-equivalence tests run scanned layers on Qwen3 and unrolled ones on Llama 3
    (each layout and each architecture once, not the four pairs: CI time); their engines keep
    the scan (`unroll_layers=False`), whose cache path the twin's test compares with."""
    return d.name.startswith("qwen3")


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def setup(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    kw = dict(rope_scaling=True) if arch == "llama3" else {}
    ref, tok = save_tiny_model_with_tokenizer(d, arch, **kw)
    # one optimizer step (SGD, large lr) on our copy: the "new weights" a sync must deliver
    ours = from_pretrained(d)
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
    opt = optax.sgd(5.0)
    batch = {"tokens": jnp.asarray([PROMPTS[0] * 4]), "positions": jnp.arange(20)[None],
             "segment_ids": jnp.ones((1, 20), jnp.int32), "loss_mask": jnp.ones((1, 20))}
    batch["targets"] = jnp.roll(batch["tokens"], -1, 1)
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    state, _ = jax.jit(make_train_step(graphdef, opt, next_token_loss))(state, batch)
    updated = nnx.merge(graphdef, state.params, state.frozen)
    from posttrain.models.export import save_hf

    save_hf(updated, d / "updated")
    return d, ref, tok, updated


@pytest.mark.parametrize("scan", [True, False])
def test_jax_engine_greedy_matches_transformers(setup, scan):
    d, ref, tok, _ = setup
    eng = JaxEngine(from_pretrained(d, scan_layers=scan), tok)
    got = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    assert got == [hf_greedy(ref, p, eos=tok.eos_token_id) for p in PROMPTS]
    # with the first greedy token as EOS every row stops at once, unless EOS is ignored
    eng.eos = sorted({g[0] for g in got})
    short = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert [len(r.token_ids) for r in short] == [1] * len(PROMPTS)
    full = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in full] == [hf_greedy(ref, p, eos=-1) for p in PROMPTS]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jax_engine_logprobs_match_trainer(setup, temperature):
    d, _, tok, _ = setup
    model = from_pretrained(d)
    eng = JaxEngine(model, tok)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=24, n=3, seed=1))
    assert len(outs) == 9 and [o.prompt_index for o in outs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    worst = 0.0
    for o in outs:
        want = trainer_logprobs(model, o.prompt_token_ids, o.token_ids, temperature)
        worst = max(worst, float(np.abs(np.asarray(o.logprobs) - want).max()))
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("semantics", ["sampled", "full"])
def test_jax_engine_logprobs_match_trainer_under_truncation(setup, semantics):
    """Every top_p in {1, 0.9, 0.5} x top_k in {0, 5, 20}: the engine's reported log-probs equal
    the trainer's under the same semantics (kept counts replayed)."""
    d, _, tok, _ = setup
    model = from_pretrained(d)
    eng = JaxEngine(model, tok)
    for top_p, top_k in TRUNCATIONS:
        sp = SamplingParams(n=2, temperature=0.7, top_p=top_p, top_k=top_k, max_tokens=16, seed=5,
                            logprobs=semantics)
        outs = eng.generate(PROMPTS, sp)
        ours, engine, mask = trainer_side(model, outs, sp)
        assert np.abs(ours - engine)[mask].max() <= 1e-4, (top_p, top_k)
        kept = [k for o in outs for k in o.kept_counts]
        if top_k or top_p < 1:
            assert max(kept) <= (top_k or model.cfg.vocab_size) and min(kept) < model.cfg.vocab_size
        else:
            assert set(kept) == {model.cfg.vocab_size}


def test_jax_engine_serves_synced_weights(setup):
    d, _, tok, updated = setup
    eng = JaxEngine(from_pretrained(d), tok)
    before = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    m = eng.update_weights(nnx.state(updated), version=1)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    new_ref = AutoModelForCausalLM.from_pretrained(d / "updated").float().eval()
    assert [o.token_ids for o in outs] == [hf_greedy(new_ref, p, eos=tok.eos_token_id) for p in PROMPTS]
    assert [o.token_ids for o in outs] != before
    assert {o.version for o in outs} == {1} and m["sync/bytes"] > 0


def test_colocated_sync_writes_into_the_engines_own_buffers_only(setup):
    """A colocated sync copies the trainer's state into the engine's previous buffers (warm
    memory, no fresh allocation) once those are the engine's own copy; an engine that borrows
    its model's arrays leaves them alive, and the trainer's arrays are never consumed."""
    d, _, tok, updated = setup
    original = from_pretrained(d)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    eng = JaxEngine(original, tok)  # borrows `original`'s arrays
    before = [r.token_ids for r in eng.generate(PROMPTS, greedy)]

    def buffers(tree):
        return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]

    borrowed = buffers(nnx.state(original))
    eng.update_weights(nnx.state(updated), version=1)
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(original)))
    assert set(buffers(eng.state)).isdisjoint(borrowed)
    own = buffers(eng.state)
    eng.update_weights(nnx.state(from_pretrained(d)), version=2)  # back to the original weights
    assert buffers(eng.state) == own  # written in place
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(updated)))
    assert [r.token_ids for r in eng.generate(PROMPTS, greedy)] == before

    # the trainer's own layout (a scanned one's unrolled twin: the test below)
    colocated = JaxEngine(from_pretrained(d), tok, copy_weights=True, unroll_layers=False)
    own = buffers(colocated.state)
    colocated.update_weights(nnx.state(updated), version=1)
    assert buffers(colocated.state) == own
    for a, b in zip(jax.tree.leaves(colocated.state), jax.tree.leaves(nnx.state(updated))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_vllm_engine_greedy_logprobs_and_sync(setup, tmp_path):
    """vLLM serves the directory `posttrain convert orbax-to-hf` wrote after an HF -> Orbax -> HF
    round trip (tokenizer and generation config carried along), and generates what transformers
    does from the original."""
    from posttrain.cli import main

    d, ref, tok, updated = setup
    assert main(["convert", "hf-to-orbax", str(d), str(tmp_path / "orbax"), "--scan-layers"]) == 0
    assert main(["convert", "orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    r = subprocess.run([sys.executable, "tests/rollout/vllm_check.py", str(tmp_path / "hf"),
                        str(d / "updated" / "model.safetensors"), json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("@@JSON@@")[1])
    want = [hf_greedy(ref, p, eos=tok.eos_token_id) for p in PROMPTS]
    assert out["greedy"] == want
    jax_eng = JaxEngine(from_pretrained(d), tok)
    assert out["greedy"] == [x.token_ids for x in jax_eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    model = from_pretrained(d)
    for key, temp in (("sampled", 1.0), ("sampled_t07", 0.7)):
        worst = max(float(np.abs(np.asarray(lps) - trainer_logprobs(model, PROMPTS[i], ids, temp)).max())
                    for i, ids, lps in out[key])
        assert worst <= 1e-3, (key, worst)
    # log-prob semantics: every truncation, both semantics, against the trainer's update path
    from rollout.engine import Rollout

    assert len(out["truncated"]) == 2 * len(TRUNCATIONS)
    for (semantics, top_p, top_k), rows in out["truncated"]:
        sp = SamplingParams(temperature=0.7, top_p=top_p, top_k=top_k, logprobs=semantics)
        outs = [Rollout(i, PROMPTS[i], ids, lps, "", "length", 0, kept_counts=kept)
                for i, ids, lps, kept in rows]
        ours, engine, mask = trainer_side(model, outs, sp)
        assert np.abs(ours - engine)[mask].max() <= 1e-3, (semantics, top_p, top_k)
        vocab = model.cfg.vocab_size
        kept = {k for *_, ks in rows for k in ks}
        if top_k or top_p < 1:
            assert max(kept) <= (top_k or vocab) and min(kept) < vocab
        else:
            assert kept == {vocab}
    new_ref = AutoModelForCausalLM.from_pretrained(d / "updated").float().eval()
    assert out["after"] == [hf_greedy(new_ref, p, eos=tok.eos_token_id) for p in PROMPTS]
    assert out["after"] != out["greedy"] and out["versions"] == [1]
    # the probe check: vLLM's scores match the trainer's for the weights it serves, and a vLLM
    # still on the old weights would be caught against the updated trainer
    from rollout.jax_engine import score_sequences
    from rollout.weight_sync import probe_gap, probe_sequences

    probe, tol = probe_sequences(model.cfg.vocab_size), out["probe_tolerance"]
    assert tol == 1e-3
    assert probe_gap(out["probe_before"], score_sequences(model, probe)) <= tol
    assert probe_gap(out["probe_after"], score_sequences(updated, probe)) <= tol
    assert probe_gap(out["probe_before"], score_sequences(updated, probe)) > 10 * tol


def test_shared_prefill_equals_one_prefill_per_sample(setup):
    """n samples of a prompt share one prefill (its KV cache repeated n times): the same tokens,
    log-probs and kept counts as the plain path, which prefills every sample's copy of the
    prompt (the same rows, so the same random draws). Log-probs within 1e-5: the prefill's
    matmuls run over fewer rows, fp32 reduction order only."""
    d, _, tok, _ = setup
    model = from_pretrained(d, scan_layers=scanned(d))
    eng = JaxEngine(model, tok, unroll_layers=False)
    n = 4
    for sp in (SamplingParams(temperature=0, max_tokens=16, n=n, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, n=n, seed=3),
               SamplingParams(temperature=0.7, top_k=20, max_tokens=16, n=n, seed=4)):
        shared = eng.generate(PROMPTS, sp)
        plain = eng.generate([p for p in PROMPTS for _ in range(n)], replace(sp, n=1))
        assert [o.prompt_index for o in shared] == [i // n for i in range(len(PROMPTS) * n)]
        assert_same_samples(model, shared, plain, sp)
        if sp.temperature > 0:  # the group's samples differ (not one sample copied n times)
            assert len({tuple(o.token_ids) for o in shared[:n]}) > 1


def test_packed_prefill_equals_the_plain_prefill(setup):
    """Prompts packed several to a row for the prefill, then laid out one per cache row: the
    same tokens and kept counts as one prompt per row, log-probs within 1e-5 (the prefill's
    matmuls run over other rows: fp32 reduction order only), greedy and sampled, n = 1 and 2."""
    from rollout.jax_engine import pack_prompts

    d, _, tok, _ = setup
    model = from_pretrained(d, scan_layers=scanned(d))
    packed = JaxEngine(model, tok, unroll_layers=False)
    plain = JaxEngine(model, tok, pack_prefill=False, unroll_layers=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(45)]
    layout = pack_prompts(prompts, 64, 32)  # the engine's buckets for these prompts
    assert layout is not None and layout["tokens"].shape[0] <= 32
    for i, p in enumerate(prompts):  # each prompt once, whole, in a segment of its own
        r, o = layout["row"][i], layout["offset"][i]
        assert layout["tokens"][r, o:o + len(p)].tolist() == p
        assert layout["positions"][r, o:o + len(p)].tolist() == list(range(len(p)))
        assert len(set(layout["segments"][r, o:o + len(p)])) == 1
        assert (layout["segments"][r] == layout["segments"][r, o]).sum() == len(p)
    for sp in (SamplingParams(temperature=0, max_tokens=16),
               SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, n=2, seed=3)):
        assert_same_samples(model, packed.generate(prompts, sp),
                            plain.generate(prompts, sp), sp)
    assert pack_prompts(PROMPTS, 8, 32) is None  # a few prompts: nothing to save, plain prefill


def test_phased_decode_equals_one_loop_over_the_whole_cache(setup):
    """The decode in phases over a cache that grows between them (`phase_ends`) against one
    loop over the whole cache: the same tokens and kept counts, log-probs within 1e-5 (masked
    slots weigh exactly 0; only fp32 summation order may differ). 70 new tokens (bucket 96:
    phases end at 32, 48, 80, 96 steps), rows that stop early, greedy and nucleus with n = 2.
    A phase that wrote one slot past its cache (XLA clamps the write onto the last slot) or a
    cache grown at the wrong end fails it."""
    from rollout.jax_engine import phase_ends

    d, _, tok, _ = setup
    model = from_pretrained(d, scan_layers=scanned(d))
    phased = JaxEngine(model, tok, decode_phases=4, unroll_layers=False)
    whole = JaxEngine(model, tok, decode_phases=1, unroll_layers=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(12)]
    assert phase_ends(96, 4) == (32, 48, 80, 96)
    for sp in (SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, max_tokens=70, n=2, seed=3,
                              stop_token_ids=[7, 11])):
        a, b = phased.generate(prompts, sp), whole.generate(prompts, sp)
        assert_same_samples(model, a, b, sp)
        lengths = {len(o.token_ids) for o in a}
        assert max(lengths) == 70 and (sp.temperature == 0 or min(lengths) < 32), lengths


def test_a_scanned_model_decodes_as_its_unrolled_twin(setup):
    """The engine decodes a scanned model with its layers unrolled (one KV buffer per layer,
    read in place; `layer_unstacker`): the same tokens and kept counts as the scan's own decode,
    log-probs within 1e-5 (the same matmuls; fp32 reduction order only), greedy and nucleus
    with n = 2 over phases; and a colocated sync of the trainer's scanned state lands in the
    engine's own buffers and serves the new weights."""
    d, _, tok, updated = setup
    model = from_pretrained(d, scan_layers=True)
    twin, scan = JaxEngine(model, tok, copy_weights=True), JaxEngine(model, tok, unroll_layers=False)
    assert not twin.cfg.scan_layers and scan.cfg.scan_layers
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(6)]
    sps = (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, n=2, seed=3))
    for sp in sps:
        assert_same_samples(model, twin.generate(prompts, sp), scan.generate(prompts, sp), sp)
    own = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(twin.state)]
    twin.update_weights(nnx.state(updated), version=1)  # scanned: from the trainer's layout
    scan.update_weights(nnx.state(updated), version=1)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(twin.state)] == own
    for sp in sps:
        assert_same_samples(updated, twin.generate(prompts, sp), scan.generate(prompts, sp), sp)


def test_phase_ends_split_the_generation_into_whole_steps():
    from posttrain.config import RolloutSection
    from rollout.jax_engine import DECODE_PHASES, phase_ends

    assert RolloutSection().decode_phases == DECODE_PHASES  # one default for recipes and the API

    assert phase_ends(64, 4) == (16, 32, 48, 64) and phase_ends(64, 2) == (32, 64)
    assert phase_ends(64, 1) == (64,) and phase_ends(32, 4) == (16, 32)
    for gen_len in range(32, 1025, 32):
        for n in (1, 2, 3, 4, 8):
            ends = phase_ends(gen_len, n)
            assert ends[-1] == gen_len and len(ends) <= n
            assert all(e % 16 == 0 and e > 0 for e in ends)
            assert list(ends) == sorted(set(ends))


def test_rows_bucket_to_powers_of_two_then_multiples_of_64():
    from rollout.jax_engine import bucket_rows

    assert [bucket_rows(n) for n in (1, 5, 8, 9, 64, 65, 300, 512)] == [8, 8, 8, 16, 64, 128, 320, 512]
    assert bucket_rows(3, minimum=1) == 4 and bucket_rows(1, minimum=1) == 1


def test_an_int8_kv_cache_is_half_the_bytes_and_stays_near_the_trainer(setup):
    """`rollout.kv_cache_dtype: int8`: keys and values stored as int8 with an f32 scale per
    token and KV head, (1 + 4 / head_dim) / 2 of a bf16 cache's bytes. The same quantized decode
    in either layer layout and with or without the packed prefill (same tokens, log-probs within
    1e-5); against the trainer's full-precision re-score the sampled tokens' log-probs move by
    the cache's rounding: above the fp32 path's 1e-4 (the int8 cache is really read) and below
    1e-2 (int8 absmax rounding is at most 1/254 of each vector's largest entry; measured 4.7e-3
    and 3.9e-3 on the tiny Qwen3 and Llama), so the probe takes the bf16 bound, 5e-2."""
    from posttrain.models.transformer import KVCache

    d, _, tok, _ = setup
    model = from_pretrained(d, scan_layers=True)
    cfg = model.cfg.model_copy(update={"scan_layers": False, "compute_dtype": "bfloat16"})
    nbytes = [sum(x.nbytes for x in jax.tree.leaves((c.k, c.v)))
              for c in (KVCache.init(cfg, 4, 64), KVCache.init(cfg, 4, 64, jnp.int8))]
    assert nbytes[1] == nbytes[0] * (1 + 4 / cfg.head_dim) / 2
    twin = JaxEngine(model, tok, kv_cache_dtype="int8")
    scan = JaxEngine(model, tok, kv_cache_dtype="int8", unroll_layers=False, pack_prefill=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(6)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, n=2, seed=3)
    a = twin.generate(prompts, sp)
    assert_same_samples(model, a, scan.generate(prompts, sp), sp)
    lp, engine_lp, mask = trainer_side(model, a, sp)
    gap = np.abs(lp - engine_lp)[mask].max()
    assert 1e-4 < gap < 1e-2, gap
    assert twin.probe_tolerance == 5e-2 and JaxEngine(model, tok).probe_tolerance == 1e-4


def test_the_pallas_decode_kernel_draws_what_xla_draws(setup):
    """`model.attention: pallas` (splash and the Pallas decode kernel) decodes with
    `decode_attention` over the KV cache, interpreted here: the same tokens and kept counts as
    XLA's attention and log-probs within 1e-5 (fp32 summation order), with the fp32 cache and
    with the int8 one, over prompts of mixed lengths (left padding masked per row), and for a
    scanned model decoded as a scan (the kernel reading each layer of the stacked cache). One
    architecture: the kernel sees only queries and the cache, which Llama's forward makes as
    Qwen3's does (the suite's time)."""
    d, _, tok, _ = setup
    xla = from_pretrained(d)
    if xla.cfg.arch != "qwen3":
        pytest.skip("the decode kernel is architecture-blind: Qwen3 covers it")
    kern = from_pretrained(d, attention="pallas")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, xla.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(5)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, n=2, seed=7)
    scanned = from_pretrained(d, attention="pallas", scan_layers=True)
    for kv in ("auto", "int8"):
        a = JaxEngine(xla, tok, kv_cache_dtype=kv).generate(prompts, sp)
        b = JaxEngine(kern, tok, kv_cache_dtype=kv).generate(prompts, sp)
        assert_same_samples(xla, a, b, sp)
        # a scanned model decoded as a scan: the kernel reads each layer of the stacked cache
        c = JaxEngine(scanned, tok, kv_cache_dtype=kv, unroll_layers=False).generate(prompts, sp)
        assert_same_samples(xla, a, c, sp)


def test_every_kv_layout_decodes_what_transposed_keys_decode(setup):
    """`model.kv_layout`: a KV cache whose keys are slot-major ([B, K, S, D], a TPU's layout:
    a decode step writes one slot as a row of D lanes in place) and one whose keys and values
    are slot-outermost ([S, K, B, D], skbd: a step writes whole tiles) decode what the
    transposed one ([B, K, D, S], CPU's) does: the same tokens and kept counts, log-probs within
    1e-5 (fp32 summation order), with the fp32 and int8 caches, through the packed prefill's
    unpacking (per layer and stacked) and the phased cache's growth, on XLA's attention
    unrolled and scanned and on the Pallas decode kernel (interpreted). The layout is really
    switched: the cache's buffers change shape."""
    from posttrain.models.transformer import KVCache

    d, _, tok, _ = setup
    ds = from_pretrained(d, kv_layout="ds")
    if ds.cfg.arch != "qwen3":
        pytest.skip("the cache layout is architecture-blind: Qwen3 covers it")
    sd, so = from_pretrained(d, kv_layout="sd"), from_pretrained(d, kv_layout="skbd")
    caches = (KVCache.init(m.cfg, 2, 48, jnp.int8) for m in (ds, sd, so))
    (k_ds, _), (k_sd, _), (k_so, v_so) = (
        (c.k, c.v) if hasattr(c.k, "scale") else (c.k[0], c.v[0]) for c in caches)  # stacked?
    hd, kh = ds.cfg.head_dim, ds.cfg.num_key_value_heads
    assert (k_ds.q.shape[-2:], k_ds.scale.shape[-2:]) == ((hd, 48), (1, 48))
    assert (k_sd.q.shape[-2:], k_sd.scale.shape[-2:]) == ((48, hd), (48, 1))
    for x in (k_so, v_so):
        assert (x.q.shape[-4:], x.scale.shape[-4:]) == ((48, kh, 2, hd), (48, kh, 2, 1))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, ds.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(5)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, n=2, seed=8)
    for kv in ("auto", "int8"):
        tol = 1e-5 if kv == "auto" else INT8_FLIP_TOL
        a = JaxEngine(ds, tok, kv_cache_dtype=kv).generate(prompts, sp)
        same = partial(assert_same_samples, ds, a, sp=sp, tol=tol)
        same(JaxEngine(sd, tok, kv_cache_dtype=kv).generate(prompts, sp))
        same(JaxEngine(sd, tok, kv_cache_dtype=kv, unroll_layers=False,
                       pack_prefill=False).generate(prompts, sp))
        same(JaxEngine(so, tok, kv_cache_dtype=kv).generate(prompts, sp))
    same(JaxEngine(so, tok, kv_cache_dtype="int8", unroll_layers=False).generate(prompts, sp))
    kern = from_pretrained(d, attention="pallas", kv_layout="sd")
    same(JaxEngine(kern, tok, kv_cache_dtype="int8").generate(prompts, sp))


def test_max_rows_splits_a_request_into_calls_of_one_program(setup):
    """`rollout.max_rows`: a request of more rows (prompts x n) than that runs as calls of at
    most that many, each prompt's samples in one call: the same greedy completions and
    log-probs as one call (within 1e-5: fp32 order), every prompt's samples under its own index,
    and a short last call padded to the others' bucket: the split request compiles no program
    beyond the one whole request's (15 prompts -> calls of 12 and 3, both in the bucket of 16)."""
    from posttrain.compile_cache import CompileTally

    d, _, tok, _ = setup
    model = from_pretrained(d)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(15)]
    sp = SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)
    whole = JaxEngine(model, tok, pack_prefill=False).generate(prompts, sp)
    split = JaxEngine(model, tok, pack_prefill=False, max_rows=24)  # 12 prompts x 2 per call
    CompileTally.install()
    before = CompileTally.snapshot()[0]
    got = split.generate(prompts, sp)
    assert CompileTally.snapshot()[0] == before
    assert [r.prompt_index for r in got] == [i // 2 for i in range(30)]
    assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in whole]
    assert_same_samples(model, got, whole, sp)


def test_continuous_batching_decodes_each_sequence_as_if_alone(setup):
    """`rollout.continuous_batching`: a request of more rows than `max_rows` decodes over one
    cache whose finished rows are refilled with the next prompts' samples (a ring of slots,
    each sequence under its own segment id). Greedy, with stop tokens that end rows at uneven
    lengths: the same completions, finish reasons and prompt indices as the whole request in
    one call, log-probs within 1e-5 (fp32 order; INT8_FLIP_TOL for int8 caches, which quantize
    keys computed in another order), over every cache layout; in fewer decode steps than the
    calls one after another (the refill is what it is for). Sampled (temperature 1, top-p 0.9):
    the trainer's log-probs of the drawn tokens, its kept sets replayed, equal the engine's."""
    d, _, tok, _ = setup
    if from_pretrained(d).cfg.arch != "qwen3":
        pytest.skip("the refill is architecture-blind: Qwen3 covers it")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 512, int(rng.integers(2, 40))).tolist() for _ in range(13)]
    stops = list(range(3, 512, 7))
    for layout, kv, n in (("ds", "auto", 2), ("sd", "int8", 3), ("skbd", "auto", 4)):
        model = from_pretrained(d, kv_layout=layout)
        sp = SamplingParams(temperature=0, max_tokens=40, n=n, ignore_eos=True,
                            stop_token_ids=stops)
        whole = JaxEngine(model, tok, pack_prefill=False, kv_cache_dtype=kv).generate(prompts, sp)
        lens = [len(r.token_ids) for r in whole]
        assert min(lens) < 10 and max(lens) == 40, lens  # uneven rows: something to refill
        calls, cont = (JaxEngine(model, tok, pack_prefill=False, kv_cache_dtype=kv,
                                 max_rows=4 * n, continuous_batching=c) for c in (False, True))
        calls.generate(prompts, sp)
        got = cont.generate(prompts, sp)
        assert cont.last_decode_steps < calls.last_decode_steps, (layout, kv)
        assert [(r.prompt_index, r.token_ids, r.finish_reason) for r in got] == \
            [(r.prompt_index, r.token_ids, r.finish_reason) for r in whole], (layout, kv)
        gap = max(np.abs(np.subtract(a.logprobs, b.logprobs)).max() for a, b in zip(whole, got))
        assert gap <= (1e-5 if kv == "auto" else INT8_FLIP_TOL), (layout, kv, gap)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, n=2, stop_token_ids=stops)
    model = from_pretrained(d)
    got = JaxEngine(model, tok, max_rows=6, continuous_batching=True).generate(prompts, sp)
    assert [r.prompt_index for r in got] == [i // 2 for i in range(26)]
    assert len({tuple(r.token_ids) for r in got}) > 13  # a sample per row, not copies
    trainer, engine, mask = trainer_side(model, got, sp)
    assert np.abs(trainer - engine)[mask].max() <= 1e-4


def test_a_request_runs_in_a_compiled_program_that_holds_it(setup):
    """`rollout.reuse_programs`: a request with no program of its own shape runs in the
    cheapest compiled one that holds it (more prompts, samples, prompt and generation slots;
    the extra rows discarded, the generation stopped at its own max_tokens): no compile, and
    the same greedy completions and log-probs (within 1e-5: fp32 order) as its own program.
    On a TPU the weight-sync probe's small requests thus run in the rollout's program instead
    of compiling decode programs of their own (30-100 s each at 0.6B). One architecture: the
    choice of program never looks at the model (the suite's time)."""
    from posttrain.compile_cache import CompileTally

    d, _, tok, _ = setup
    model = from_pretrained(d)
    if model.cfg.arch != "qwen3":
        pytest.skip("the program a request runs in is architecture-blind: Qwen3 covers it")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(rng.integers(2, 30))).tolist()
               for _ in range(6)]
    riding = JaxEngine(model, tok, pack_prefill=False, reuse_programs=True)
    riding.generate(prompts, SamplingParams(temperature=0, max_tokens=40, n=4, ignore_eos=True))
    assert len(riding.programs) == 1
    sp = SamplingParams(temperature=0, max_tokens=10, n=2, ignore_eos=True)
    own = JaxEngine(model, tok, pack_prefill=False, reuse_programs=False).generate(PROMPTS, sp)
    CompileTally.install()
    before = CompileTally.snapshot()[0]
    got = riding.generate(PROMPTS, sp)
    assert CompileTally.snapshot()[0] == before and len(riding.programs) == 1
    assert [r.prompt_index for r in got] == [0, 0, 1, 1, 2, 2]
    assert all(len(r.token_ids) == 10 for r in got)
    assert_same_samples(model, got, own, sp)
    # a request that no compiled program holds (more prompts) compiles its own
    riding.generate(prompts + PROMPTS, sp)
    assert len(riding.programs) == 2


def test_the_cheapest_compiled_program_that_holds_a_request_is_chosen():
    from rollout.jax_engine import ProgramShape, fitting_program

    small = ProgramShape(8, 32, 64, 8, 4, 0)
    big = ProgramShape(64, 128, 256, 8, 4, 0)
    need = ProgramShape(4, 32, 32, 2, 4, 0)
    prompts = [[1, 2, 3]] * 4
    assert fitting_program({big, small}, need, prompts) == (small, None)
    assert fitting_program({big}, need._replace(gen_len=512), prompts) is None
    assert fitting_program({big}, need._replace(stops=8), prompts) is None  # stop slots differ
    assert fitting_program({small}, need._replace(group=16), prompts) is None
    # its own bucket's rows do not matter, only its prompts (8 single-sample requests bucket to
    # 8 rows; 2 of them ride a program of 2 prompts x 4 samples, as a small held-out set does)
    two = ProgramShape(2, 32, 64, 4, 4, 0)
    assert fitting_program({two}, ProgramShape(8, 32, 32, 1, 4, 0), prompts[:2]) == (two, None)
    assert fitting_program({two}, ProgramShape(8, 32, 32, 1, 4, 0), prompts[:3]) is None
    packed = ProgramShape(16, 32, 64, 1, 4, 2)
    shape, packing = fitting_program({packed}, ProgramShape(4, 32, 32, 1, 4, 0), prompts)
    assert shape == packed and packing["tokens"].shape == (2, 32)
    assert fitting_program({packed}, ProgramShape(16, 32, 32, 1, 4, 0), [[1] * 30] * 16) is None
