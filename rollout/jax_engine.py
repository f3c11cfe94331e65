"""The native JAX rollout engine: prefill + batched decode on the trainer's own model code.

One jitted function does the whole generation: a prefill of the (right-padded) prompts into the
KV cache, then `lax.while_loop`s that sample a token per sequence, feed it back, and stop as soon
as every sequence has hit a stop token or the length limit. No Python runs per token. The n
samples of a prompt share its prefill (its KV cache repeated n times), and many short prompts are
prefilled packed several to a row, then laid out one per cache row. The decode runs in a few
phases (one loop each) over a cache that grows between them, so a step reads only the slots
that can be filled by then (`phase_ends`). Shapes are bucketed (rows to a power of two up to
64, then a multiple of 64; prompt and generation lengths to multiples of 32) so a new batch
rarely compiles. A request of more rows than `max_rows` runs as calls of that many rows, or,
with `continuous_batching`, through one program whose finished rows are refilled with the next
prompts' samples (`_continuous_impl`). With a sharded model the same functions run over the
mesh.
"""

from __future__ import annotations

import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from functools import cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.data.packing import bucket_up, packed_rows
from posttrain.models.export import host_array
from posttrain.models.hf import our_path, our_tensors
from posttrain.models.layers import kv_axes
from posttrain.models.loading import set_params
from posttrain.models.transformer import CausalLM, KVCache, layer_unstacker
from posttrain.train.step import token_logprobs
from rollout.buckets import Digest
from rollout.engine import Rollout, SamplingParams, stop_string_cut
from rollout.sampling import sample


def bucket_pow2(n: int, minimum: int = 8) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def bucket_mult(n: int, m: int = 32) -> int:
    return max(m, -(-n // m) * m)


def bucket_rows(n: int, minimum: int = 8, step: int = 64) -> int:
    """Batch rows: powers of two up to `step`, then multiples of it (300 held-out problems
    decode as 320 rows, not 512)."""
    return bucket_pow2(n, minimum) if n <= step else bucket_mult(n, step)


DECODE_PHASES = 4  # the default of `rollout.decode_phases`


def phase_ends(gen_len: int, max_phases: int, step: int = 16) -> tuple[int, ...]:
    """How many decode steps have run when each phase of the decode ends: `gen_len` split into
    at most `max_phases` runs of whole multiples of `step` (the last ends at `gen_len`).

    A decode step attends over every slot of the KV cache, filled or not, and reading those
    slots is most of what a step costs beyond the weights (the step time grows linearly with
    the slots). Phase j's cache holds the prompt bucket and only the `phase_ends[j]` slots its
    steps can fill, so the first steps of a 64-token generation read 48 slots, not 96. Each
    phase is a loop body of its own to compile, and at the last boundary the grown cache and the
    one before it coexist (peak KV memory up to ~1.75x one full cache with 4 phases;
    `posttrain.plan` counts both)."""
    chunks = max(1, gen_len // step)
    n = max(1, min(max_phases, chunks))
    ends = tuple(-(-chunks * j // n) * step for j in range(1, n + 1))
    return ends[:-1] + (gen_len,)


def _generate_impl(graphdef, state, tokens_bt, lens_b, key, temperature, top_k, top_p, full,
                   max_new, stop_ids, gen_len: int, group: int = 1, packing=None,
                   phases: tuple[int, ...] = (), kv_int8: bool = False):
    """`tokens_bt` [P, T]: the distinct prompts, each prefilled once; its KV cache and last
    logits are then repeated `group` times, so rows i * group .. i * group + group - 1 of the
    P * group decoded in lockstep are the group's samples of prompt i (GRPO's G completions
    share one prefill). `packing`: None, or the prompts packed several to a row for the prefill
    (`pack_prompts`), which then runs over fewer padded positions. `phases`: `phase_ends`, the
    decode run as one `while_loop` per phase over a cache that grows between them (empty: one
    loop over the whole cache); the tokens are the same either way (masked slots weigh exactly
    0), the log-probs equal up to fp32 summation order. `kv_int8`: the KV cache in int8 with a
    scale per token and head (`QuantizedKV`), half the bytes to hold and to read per step."""
    model = nnx.merge(graphdef, state)
    kv_dtype = jnp.int8 if kv_int8 else None
    u, tp = tokens_bt.shape
    ends = phases or (gen_len,)
    if packing is None:
        last, cache = _prefill(model, tokens_bt, lens_b, tp + ends[0], kv_dtype)
    else:
        cache, last = _packed_prefill(model, packing, lens_b, tp + ends[0], kv_dtype)
    cache, last, lens_b = (cache.repeat(group, model.cfg), jnp.repeat(last, group, 0),
                          jnp.repeat(lens_b, group))
    b = u * group

    def cond(c, end):  # a forward per token but the last: it is sampled, never fed back
        i, done = c[0], c[-2]
        return (i < jnp.minimum(max_new - 1, end)) & ~jnp.all(done)

    def emit(i, logits, c):
        """Sample token i from `logits` and record it in the carry `c`."""
        _, cache, _, out_t, out_lp, out_k, done, n = c
        tok, lp, kept = sample(jax.random.fold_in(key, i), logits, temperature, top_k, top_p, full)
        tok = jnp.where(done, 0, tok).astype(jnp.int32)
        out_t = out_t.at[:, i].set(tok)
        out_lp = out_lp.at[:, i].set(jnp.where(done, 0.0, lp))
        out_k = out_k.at[:, i].set(kept)
        n = n + (~done).astype(jnp.int32)
        done = done | hits_stop(tok, stop_ids) | (i + 1 >= max_new)
        return i, cache, tok, out_t, out_lp, out_k, done, n

    def body(c):
        """Feed token i, sample token i + 1 from its logits: the loop carries tokens, never the
        [B, V] logits (XLA:TPU copied a carried f32 [128, 151936] every step, 240 us)."""
        i, cache, tok = c[:3]
        logits, cache = model(tok[:, None], (lens_b + i)[:, None],
                              jnp.ones((b, 1), jnp.int32), cache=cache)
        return emit(i + 1, logits[:, 0], (i + 1, cache) + c[2:])

    c = (jnp.int32(0), cache, jnp.zeros((b,), jnp.int32), jnp.zeros((b, gen_len), jnp.int32),
         jnp.zeros((b, gen_len), jnp.float32), jnp.zeros((b, gen_len), jnp.int32),
         jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32))
    c = emit(0, last, c)  # token 0, from the prefill's last logits
    for j, end in enumerate(ends):
        if j:  # room for this phase's tokens
            c = (c[0], c[1].grow(tp + end, model.cfg)) + c[2:]
        c = jax.lax.while_loop(partial(cond, end=end), body, c)
    _, _, _, out_t, out_lp, out_k, _, n = c
    return out_t, out_lp, out_k, n


def hits_stop(tok_b, stop_ids):
    """[B]: whether each token is one of `stop_ids` (padded with -1, which no token is)."""
    return jnp.any(tok_b[:, None] == stop_ids[None, :], axis=-1)


def refill_prompts(per_call: int) -> int:
    """Prompts one refill of `_continuous_impl` prefills, for a cache of `per_call` prompts'
    groups: an eighth of them (one group in GRPO's 8 prompts per call)."""
    return max(1, per_call // 8)


def _prefill(model, tokens_bt, lens_b, slots: int, kv_dtype=None):
    """The prompts [U, T] (right-padded to T, `lens_b` tokens each) into a new cache of `slots`
    slots, and each prompt's last logits [U, V] (the head runs on the last tokens only)."""
    u, tp = tokens_bt.shape
    cache = KVCache.init(model.cfg, u, slots, kv_dtype)
    pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (u, tp))
    seg = (pos < lens_b[:, None]).astype(jnp.int32)
    last, cache = model(tokens_bt, pos, seg, cache, head=lambda x, lm_head: lm_head(
        jnp.take_along_axis(x, (lens_b - 1)[:, None, None], axis=1))[:, 0])
    return last, cache


def _put(big, small, rows, slots, row_axis: int, slot_axis: int):
    """`big` with `small`'s rows i and slots t written at rows[i] and slots[t] (axes counted from
    the end, as `kv_axes` gives them; a row index out of range is dropped): a scatter."""
    ra, sa = big.ndim + row_axis, big.ndim + slot_axis
    idx = [slice(None)] * big.ndim
    idx[ra], idx[sa] = rows[:, None], slots[None, :]
    # NumPy's rule: advanced indices apart put their broadcast [rows, slots] first, side by side
    # in place of the first of them
    at = (0, 1) if abs(ra - sa) > 1 else (min(ra, sa), min(ra, sa) + 1)
    return big.at[tuple(idx)].set(jnp.moveaxis(small, (ra, sa), at), mode="drop")


def _continuous_impl(graphdef, state, tokens_pt, lens_p, n_prompts, key, temperature, top_k,
                     top_p, full, max_new, stop_ids, rows: int, gen_len: int, group: int,
                     refill: int, kv_int8: bool = False):
    """Continuous batching: the n = `group` samples of each of the first `n_prompts` prompts of
    `tokens_pt` [P, T] decoded over a cache of `rows` rows, a finished row refilled with the
    next prompt's samples as soon as `refill` prompts' groups fit in the free rows (one prefill
    of those prompts, its cache repeated `group` times), instead of waiting for the longest row
    of a batch. Returns out_t, out_lp, out_k [P * group, gen_len] and the counts n [P * group]
    of sequence j = sample j % group of prompt j // group, as `_generate_impl` returns them,
    and the decode steps run.

    The cache is a ring of T + gen_len slots written one shared slot per step (`KVCache.end`,
    modulo the ring), as the lockstep decode writes it: a sequence that starts at step e has its
    prompt put in the ring's T slots before e and its tokens in the slots from e on, never more
    than the ring holds, and its slots carry its own segment id (sequence + 1), so the attention
    mask (segment equality, position order) keeps each sequence to its own slots whatever the
    row held before. The tokens and log-probs are those of the lockstep decode of each
    sequence alone (greedy: the same tokens; sampled: the same distribution, other draws)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    kv_dtype = jnp.int8 if kv_int8 else None
    _, tp = tokens_pt.shape
    ring = tp + gen_len
    seqs = tokens_pt.shape[0] * group
    fill = refill * group  # rows one refill takes
    (k_rows, k_slots, _), (v_rows, v_slots, _) = kv_axes(cfg, True), kv_axes(cfg, False)
    cache = KVCache.init(cfg, rows, ring, kv_dtype)
    cache = cache._replace(end=jnp.int32(tp))
    key_step, key_fill = jax.random.split(key)

    def record(out, seq, i, tok, lp, kept):
        """Token i of each sequence `seq` (out of range: dropped) into the outputs."""
        out_t, out_lp, out_k = out
        return (out_t.at[seq, i].set(tok, mode="drop"), out_lp.at[seq, i].set(lp, mode="drop"),
                out_k.at[seq, i].set(kept, mode="drop"))

    def can_refill(c):
        waiting = jnp.minimum(n_prompts - c["next"], refill)
        return (waiting > 0) & (jnp.sum(~c["live"]) >= waiting * group)

    def refill_rows(c):
        """Prefill the next `refill` prompts and start their samples in free rows."""
        q = c["next"]
        first = q + jnp.arange(refill, dtype=jnp.int32)
        lens = jax.lax.dynamic_slice_in_dim(lens_p, q, refill)
        last, small = _prefill(model, jax.lax.dynamic_slice_in_dim(tokens_pt, q, refill), lens,
                               tp, kv_dtype)
        small, last = small.repeat(group, cfg), jnp.repeat(last, group, 0)
        seq = (first[:, None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(-1)
        real = jnp.repeat(first < n_prompts, group)
        target = jnp.nonzero(~c["live"], size=fill, fill_value=rows)[0]
        target = jnp.where(real, target, rows)  # a prompt past the last: no row
        big = c["cache"]
        slots = (big.end - tp + jnp.arange(tp, dtype=jnp.int32)) % ring
        k = jax.tree.map(lambda b, s: _put(b, s, target, slots, k_rows, k_slots), big.k, small.k)
        v = jax.tree.map(lambda b, s: _put(b, s, target, slots, v_rows, v_slots), big.v, small.v)
        seg = jnp.where(small.seg != 0, seq[:, None] + 1, 0)
        big = big._replace(k=k, v=v, pos=_put(big.pos, small.pos, target, slots, -2, -1),
                           seg=_put(big.seg, seg, target, slots, -2, -1))
        tok, lp, kept = sample(jax.random.fold_in(key_fill, q), last, temperature, top_k, top_p,
                               full)
        tok = tok.astype(jnp.int32)
        seq = jnp.where(real, seq, seqs)
        done = hits_stop(tok, stop_ids) | (max_new <= 1)

        def at_rows(x, value):
            return x.at[target].set(value, mode="drop")

        return {**c, "cache": big, "out": record(c["out"], seq, 0, tok, lp, kept),
                "n": c["n"].at[seq].set(1, mode="drop"), "next": q + refill,
                "seq": at_rows(c["seq"], seq), "i": at_rows(c["i"], 1),
                "tok": at_rows(c["tok"], tok), "len": at_rows(c["len"], jnp.repeat(lens, group)),
                "live": at_rows(c["live"], ~done)}

    def step(c):
        """Refill what fits, then feed every live row its last token and sample the next."""
        c = jax.lax.while_loop(can_refill, refill_rows, c)
        live, i = c["live"], c["i"]
        logits, cache = model(c["tok"][:, None], (c["len"] + i - 1)[:, None],
                              jnp.where(live, c["seq"] + 1, 0)[:, None], cache=c["cache"])
        cache = cache._replace(end=cache.end % ring)
        tok, lp, kept = sample(jax.random.fold_in(key_step, c["steps"]), logits[:, 0],
                               temperature, top_k, top_p, full)
        tok = tok.astype(jnp.int32)
        seq = jnp.where(live, c["seq"], seqs)
        return {**c, "cache": cache, "out": record(c["out"], seq, i, tok, lp, kept),
                "n": c["n"].at[seq].add(1, mode="drop"), "i": i + 1, "tok": tok,
                "live": live & ~hits_stop(tok, stop_ids) & (i + 1 < max_new),
                "steps": c["steps"] + 1}

    def running(c):
        return jnp.any(c["live"]) | (c["next"] < n_prompts)

    zeros = partial(jnp.zeros, dtype=jnp.int32)
    c = {"cache": cache, "next": jnp.int32(0), "steps": jnp.int32(0),
         "seq": zeros((rows,)), "i": zeros((rows,)), "tok": zeros((rows,)), "len": zeros((rows,)),
         "live": jnp.zeros((rows,), bool), "n": zeros((seqs,)),
         "out": (zeros((seqs, gen_len)), jnp.zeros((seqs, gen_len), jnp.float32),
                 zeros((seqs, gen_len)))}
    c = jax.lax.while_loop(running, step, c)
    return (*c["out"], c["n"], c["steps"])


# XLA:TPU's memory-space assignment (MSA) copies a buffer into the chip's VMEM ahead of a use
# when its cost model expects the use to gain. In the decode loop it picked every layer's whole
# KV cache, read once per step by that layer's attention: a copy (or four sliced copies) of the
# cache per layer per step, each waited on before the attention could run. On a v5e at 128 x
# (128 + 128) the copies' waits took 326 ms of a 1,315 ms generation, and the step went from 8.06
# to 9.30 ms when a change to the sampler freed the VMEM its logits had held (BENCHMARKS.md). MSA
# counts a VMEM allocation inefficient, and drops it, when its uses read fewer bytes than this
# ratio times what it copies (XLA's default 0.5): at 1.0 no KV buffer is copied into VMEM in the
# decode loop (`benchmarks.tpu.decode_compile`'s `kv_vmem_copies_per_step`), and attention
# streams the cache from HBM once per step, while the weights' sliced prefetches remain.
TPU_DECODE_OPTIONS = {"xla_tpu_msa_inefficient_use_to_copy_ratio": 1.0}


@cache
def _program(tpu: bool, options: tuple, continuous: bool) -> Callable:
    impl, static = ((_continuous_impl, ("graphdef", "rows", "gen_len", "group", "refill", "kv_int8"))
                    if continuous else
                    (_generate_impl, ("graphdef", "gen_len", "group", "phases", "kv_int8")))
    return jax.jit(impl, static_argnames=static,
                   compiler_options={**(TPU_DECODE_OPTIONS if tpu else {}), **dict(options)} or None)


def generate_program(platform: str | None, options: dict | None = None,
                     continuous: bool = False) -> Callable:
    """The jitted `_generate_impl` (`continuous`: `_continuous_impl`) for a platform ("tpu",
    "cpu", ...): with XLA options of its own where that platform's compiler needs them
    (TPU_DECODE_OPTIONS), plain elsewhere. `options`: more XLA options over those (a
    benchmark's A/B), a program of their own."""
    return _program(platform == "tpu", tuple(sorted((options or {}).items())), continuous)


class ProgramShape(NamedTuple):
    """What a decode program of `_generate_impl` is compiled for: prompts (prefill rows), prompt
    slots, generation slots, samples per prompt, stop-id slots, packed prefill rows (0: none)."""
    prompts: int
    prompt_len: int
    gen_len: int
    group: int
    stops: int
    packed: int

    def cost(self) -> int:
        return self.prompts * self.group * (self.prompt_len + self.gen_len)


def fitting_program(compiled, need: ProgramShape, prompts: list[list[int]]):
    """The cheapest compiled program that can run a request of shape `need` (as many prompts,
    samples, prompt and generation slots or more; the same stop slots; its prompts packed into
    its packed rows if it packs): (shape, packing) or None. Its extra rows and samples are
    discarded; a generation stops at the request's `max_tokens` (a traced argument). A program
    holds up to its `prompts` prompts whatever rows the request's own bucket would have (two
    held-out problems, whose own program would have 8 rows, ride one of 2 prompts x 4 samples)."""
    for c in sorted(compiled, key=ProgramShape.cost):
        if (c.stops != need.stops or c.group < need.group or c.prompts < len(prompts)
                or c.prompt_len < need.prompt_len or c.gen_len < need.gen_len):
            continue
        if not c.packed:
            return c, None
        packing = pack_prompts(prompts, c.prompts, c.prompt_len, n_rows=c.packed)
        if packing is not None:
            return c, packing
    return None


def pack_prompts(prompts: list[list[int]], rows: int, row_len: int,
                 n_rows: int | None = None) -> dict | None:
    """The prompts packed first-fit decreasing into rows of `row_len` tokens for one prefill
    (segment ids keep each prompt's attention to itself, positions restart per prompt), with
    where each prompt lies (`row`, `offset`); the row count bucketed (`bucket_up` in 8s). None
    when that saves fewer than a quarter of the `rows` x `row_len` positions the plain prefill
    runs (a GRPO batch's few distinct prompts, prompts near the bucket's length). With
    `n_rows`: exactly that many packed rows (a compiled program's), None if they do not fit."""
    layout = [r for r in packed_rows([len(p) for p in prompts], row_len, 1) if r]
    if n_rows is not None:
        if len(layout) > n_rows:
            return None
    else:
        n_rows = bucket_up(len(layout), 8)
        if n_rows > 0.75 * rows:
            return None
    tokens, pos, seg = (np.zeros((n_rows, row_len), np.int32) for _ in range(3))
    row, offset = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
    for r, members in enumerate(layout):
        at = 0
        for k, i in enumerate(members):
            n = len(prompts[i])
            tokens[r, at:at + n], pos[r, at:at + n], seg[r, at:at + n] = prompts[i], np.arange(n), k + 1
            row[i], offset[i] = r, at
            at += n
    return {"tokens": tokens, "positions": pos, "segments": seg, "row": row, "offset": offset}


def _packed_prefill(model, packing, lens_b, slots: int, kv_dtype=None):
    """Prefill the packed rows, then lay each prompt's keys/values out as its own cache row
    (slots 0 .. T-1 hold its tokens, the rest of its first T slots empty), as the plain prefill
    leaves them; and each prompt's last logits."""
    tokens, row, offset = packing["tokens"], packing["row"], packing["offset"]
    r, t = tokens.shape
    packed = KVCache.init(model.cfg, r, t, kv_dtype)
    # each prompt's last logits: [U, V]
    last, packed = model(tokens, packing["positions"], packing["segments"], packed,
                         head=lambda x, lm_head: lm_head(x[row, offset + lens_b - 1]))
    j = jnp.arange(t, dtype=jnp.int32)
    src = jnp.minimum(offset[:, None] + j, t - 1)  # [U, T]: the packed slot of prompt i's token j
    valid = j[None, :] < lens_b[:, None]

    def unpack(buf, slot_axis: int):  # [R, K, D, T] (transposed keys) or [R, K, T, D] -> [U, ...]
        if slot_axis == 0:  # [T, K, R, D] (`kv_layout` skbd): as [R, K, T, D] and back
            return unpack(buf.transpose(2, 1, 0, 3), 2).transpose(2, 1, 0, 3)
        rows = buf[row]
        idx = src[:, None, None, :] if slot_axis == 3 else src[:, None, :, None]
        keep = valid[:, None, None, :] if slot_axis == 3 else valid[:, None, :, None]
        out = jnp.where(keep, jnp.take_along_axis(rows, idx, axis=slot_axis), 0)
        pad = [(0, 0)] * out.ndim
        pad[slot_axis] = (0, slots - t)
        return jnp.pad(out, pad)

    k_slots, v_slots = (4 + kv_axes(model.cfg, key)[1] for key in (True, False))  # of 4 axes
    if model.cfg.scan_layers:  # [L, ...]
        k = jax.tree.map(jax.vmap(lambda b: unpack(b, k_slots)), packed.k)
        v = jax.tree.map(jax.vmap(lambda b: unpack(b, v_slots)), packed.v)
    else:  # a buffer per layer (int8: its values and scales alike)
        k = jax.tree.map(lambda b: unpack(b, k_slots), packed.k)
        v = jax.tree.map(lambda b: unpack(b, v_slots), packed.v)
    pos = jnp.pad(jnp.where(valid, j, 0), ((0, 0), (0, slots - t)))
    seg = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, slots - t)))
    return KVCache(k, v, pos, seg, jnp.asarray(t, jnp.int32)), last


# The smallest shape `score_sequences` runs: every request of the weight-sync probe (4 sequences
# of 24 tokens teacher-forced, the re-scores of 8 sampled sequences of <= 46 tokens and of 16 of
# <= 25: `rollout.engine.sampling_request`) fits it, so each model compiles one scoring program
# (three before, each 7-22 s on a TPU v5e at the 0.6B shape, in the first steps of a cold run)
SCORE_ROWS, SCORE_TOKENS = 16, 64


@partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, tokens_bt, lens_b):
    model = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    logits = model(tokens_bt, pos, (pos < lens_b[:, None]).astype(jnp.int32))
    return token_logprobs(logits[:, :-1], tokens_bt[:, 1:])


def score_sequences(model_or_split, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced log p(token_t | tokens_<t), t >= 1, under the full softmax at temperature 1,
    of each sequence: what an engine proves it serves the trainer's weights with (the trainer
    scores with the same function). `model_or_split`: a model or its (graphdef, state)."""
    graphdef, state = (nnx.split(model_or_split) if isinstance(model_or_split, nnx.Module)
                       else model_or_split)
    tokens, lens = _padded(sequences, bucket_pow2(len(sequences), SCORE_ROWS),
                           bucket_up(max(max(map(len, sequences)), SCORE_TOKENS)))
    lp = host_array(_score(graphdef, state, tokens, lens))
    return [lp[i, :len(s) - 1].tolist() for i, s in enumerate(sequences)]


def fp32_matmuls() -> bool:
    """Whether fp32 matmuls run at fp32 precision here: everywhere but on a TPU, whose default
    precision for them is one bf16 pass (`jax_default_matmul_precision` raises it)."""
    precision = str(jax.config.jax_default_matmul_precision or "").lower()
    return jax.default_backend() != "tpu" or precision in ("highest", "float32")


def _adopt(arr: np.ndarray, borrow: bool) -> jax.Array:
    """`arr` as a JAX array: wrapping its memory when borrowed on CPU, else a copy finished
    before returning (`arr` may view a buffer that is reused next, and JAX copies host data
    asynchronously)."""
    if borrow and arr.flags.c_contiguous and jax.default_backend() == "cpu":
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is read-only: it stays so
            return jax.dlpack.from_dlpack(torch.from_numpy(arr))  # JAX copies if misaligned
    return jnp.array(arr, copy=True).block_until_ready()


@jax.jit
def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


@partial(jax.jit, donate_argnums=0, keep_unused=True)
def _copy_into(old, new):
    """`new`'s values written into `old`'s buffers (donated; same tree, shapes and dtypes).
    Memory the engine has already touched: a fresh copy of a 2 GB state page-faults its way in
    at a third of memcpy speed on these CPUs (504M model: 0.45 s, against 0.16 s for a numpy copy
    into warm memory)."""
    del old
    return jax.tree.map(jnp.copy, new)


def _copy(tree, into=None):
    """The engine's own copy of `tree` (the same layout), into `into`'s buffers when given."""
    return _copy_tree(tree) if into is None else _copy_into(into, tree)


def _same_arrays(a, b) -> bool:
    """Same tree, and every leaf the same shape and dtype."""
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(x.shape == y.shape and x.dtype == y.dtype
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


class JaxEngine:
    def __init__(self, model: CausalLM, tokenizer=None, *, eos_token_ids: Sequence[int] = (),
                 version: int = 0, seed: int = 0, copy_weights: bool = False,
                 pack_prefill: bool = True, decode_phases: int = DECODE_PHASES,
                 unroll_layers: bool = True, kv_cache_dtype: str = "auto", max_rows: int = 0,
                 lora_scale: float | None = None, reuse_programs: bool | None = None,
                 continuous_batching: bool = False):
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        # `_take(state[, into])`: the engine's own copy of a state in the layout the model was
        # given in (`_given`). A scanned model decodes as its unrolled twin (`layer_unstacker`):
        # one KV buffer per layer, read in place; its copies are unstacked (a LoRA model's
        # adapters merged into its kernels with `lora_scale`, alpha / rank).
        self._given = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
        self._take = _copy
        if unroll_layers and self.cfg.scan_layers:
            self.graphdef, self._take = layer_unstacker(self.cfg, lora_scale)
            self.cfg = self.cfg.model_copy(update={"scan_layers": False})
        self.pack_prefill = pack_prefill  # prompts several to a row in the prefill (`pack_prompts`)
        self.decode_phases = decode_phases  # at most this many cache lengths (`phase_ends`)
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: auto (the compute dtype) or int8")
        self.kv_int8 = kv_cache_dtype == "int8"
        # at most this many sampled rows (prompts x n) per decode program, 0: all at once
        self.max_rows = max_rows
        # a request of more rows than that: finished rows refilled (`_continuous_impl`) instead
        # of calls one after another, each as long as its longest row
        self.continuous_batching = continuous_batching
        self.last_decode_steps = 0  # decode steps of the last request (all its calls)
        self.continuous_shapes: set[tuple] = set()  # the continuous programs' static shapes
        # the decode programs compiled so far, and whether a request may run in a bigger one
        self.programs: set[ProgramShape] = set()
        self.reuse_programs = (jax.default_backend() != "cpu" if reuse_programs is None
                               else reuse_programs)
        # Whether `state` is the engine's own copy (nobody else holds its buffers), which a sync
        # may then overwrite in place: when colocated with a trainer that donates its buffers,
        # or unstacked.
        self._owns_state = copy_weights or self._take is not _copy
        if self._owns_state:
            self.state = self._take(self.state)
        self.tokenizer = tokenizer
        eos = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = sorted(eos)
        self.version = version
        self._calls = 0
        self._seed = seed

    # ---- weights ---------------------------------------------------------------------------
    weight_layout = "jax"  # what `load_weights` takes best: our orientation, no transposes
    copies_on_load = True  # `load_weights` is done with its (non-borrowed) inputs on return

    @property
    def weight_dtype(self) -> str:
        return str(next(x.dtype for x in jax.tree.leaves(self.state)
                        if jnp.issubdtype(x.dtype, jnp.floating)))

    def update_weights(self, weights, version: int) -> dict[str, float]:
        """`weights`: an nnx.State in the layout of the model the engine was built from
        (colocated: handed over as is), or a mapping of HF tensor names to arrays in HF layout."""
        t0 = time.perf_counter()
        if isinstance(weights, nnx.State):
            nbytes = sum(x.nbytes for x in jax.tree.leaves(weights))
            # Own copy: the trainer donates its state buffers to the next step. The same tree
            # as the engine's (the colocated case): one jitted copy of every leaf, one dispatch,
            # into the engine's previous buffers when they are its own. A scanned trainer's
            # state is unstacked (`layer_unstacker`) the same way.
            if _same_arrays(weights, self._given):  # the whole state, as the model was given
                self.state = self._take(weights, self.state if self._owns_state else None)
                self._owns_state = True
            else:  # a part of the state (the parameters): merged in
                nnx.update(model := nnx.merge(self.graphdef, self.state), self._take(weights))
                _, self.state = nnx.split(model)
            self.version = version
        else:
            self.start_weight_update(version)
            self.load_weights(weights.items(), "hf")
            self.finish_weight_update(version)
            nbytes = sum(np.asarray(v).nbytes for v in weights.values())
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    def start_weight_update(self, version: int, check_digest: bool = False) -> None:
        """Begin a streamed update: tensors arrive by HF name in any grouping (`load_weights`),
        each stacked parameter is assembled as its layers arrive, and `finish_weight_update`
        swaps the new parameters in at once (no request sees half of them)."""
        self._targets = our_tensors(self.cfg)
        self._incoming, self._ready = {}, {}
        self._digest = Digest() if check_digest else None

    def load_weights(self, tensors, layout: str = "hf", borrow: bool = False) -> None:
        """Tensors by HF name, in `layout`. With `borrow` the arrays are immutable and live as
        long as they are referenced (Ray's shared memory): on CPU a parameter that needs no
        transpose or cast then wraps that memory (DLPack, no copy), so every worker on a node
        serves one shared copy of the weights; otherwise each is copied."""
        for name, arr in tensors:
            if self._digest is not None:
                self._digest.update([(name, arr)])
            path, index, transpose = our_path(self.cfg, name)
            names, _, stack = self._targets[path]
            arr = arr if isinstance(arr, np.ndarray) else np.asarray(jax.device_get(arr))
            if transpose and layout == "hf":
                arr = arr.T
            if not stack:
                self._ready[path] = _adopt(arr, borrow)
                continue
            buf, left = self._incoming.get(path) or (np.empty(stack + arr.shape, arr.dtype), len(names))
            buf[index] = arr
            if left == 1:
                self._ready[path] = jnp.asarray(buf)
                self._incoming.pop(path, None)
            else:
                self._incoming[path] = (buf, left - 1)

    def finish_weight_update(self, version: int) -> str | None:
        """Swap the received parameters in; every one must have arrived in full. Returns the
        digest of what was loaded when `start_weight_update` asked for it."""
        missing = sorted(".".join(map(str, p)) for p in self._targets if p not in self._ready)
        if missing:
            raise RuntimeError(f"weight update to version {version} incomplete: "
                               f"{len(missing)} parameter(s) not received, e.g. {missing[:3]}")
        model = set_params(nnx.merge(self.graphdef, self.state), self._ready)
        _, self.state = nnx.split(model)
        self._owns_state = False  # parameters may wrap memory the engine borrowed (`load_weights`)
        self._incoming = self._ready = None
        self.version = version
        self.last_digest = self._digest.hexdigest() if self._digest is not None else None
        return self.last_digest

    @property
    def probe_tolerance(self) -> float:
        """Largest probe log-prob gap to the trainer that still means "same weights": the same
        model code runs on both sides (fp32: differences are reduction order only). On a TPU an
        fp32 matmul at the default precision is one bf16 pass, so fp32 weights there get the
        bf16 bound (the quickstart's sampling path measured 0.0125 from the trainer's re-score
        on a v5e at the default precision). An int8 KV cache moves the sampling path's
        log-probs by its rounding (~5e-3 on the test models): the bf16 bound too."""
        wide = all(x.dtype == jnp.float32 for x in jax.tree.leaves(self.state)
                   if jnp.issubdtype(x.dtype, jnp.floating))
        return 1e-4 if wide and fp32_matmuls() and not self.kv_int8 else 5e-2

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return score_sequences((self.graphdef, self.state), sequences)

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """n samples of each prompt (`rollouts[i * n + j]`: sample j of prompt i); with
        `max_rows`, over calls of at most that many rows (prompts x n) of one program each,
        whose KV cache is then that many rows' (a seeded request: a seed per call)."""
        prompts = [list(p) for p in prompt_token_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        per_call = max(1, self.max_rows // params.n) if self.max_rows else len(prompts)
        self.last_decode_steps = 0
        if len(prompts) <= per_call:
            return self._generate(prompts, params)
        if self.continuous_batching:
            return self._generate_continuous(prompts, params, per_call)
        out = []
        for c, i in enumerate(range(0, len(prompts), per_call)):
            p = params if params.seed is None else replace(params, seed=params.seed + 7919 * c)
            out += [replace(r, prompt_index=r.prompt_index + i)
                    for r in self._generate(prompts[i:i + per_call], p, min_prompts=per_call)]
        return out

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  min_prompts: int = 1) -> list[Rollout]:
        if not prompts:
            return []
        # each prompt prefilled once for its n samples; a call's rows bucketed to at least
        # `min_prompts`' (the last of a split request compiles nothing new)
        u = bucket_rows(max(len(prompts), min_prompts), minimum=max(1, -(-8 // params.n)))
        tp = bucket_up(max(len(p) for p in prompts))
        stop = self._stop_ids(params)
        packing = pack_prompts(prompts, u, tp) if self.pack_prefill else None
        shape = ProgramShape(u, tp, bucket_mult(params.max_tokens), params.n,
                             bucket_pow2(len(stop), 4),
                             0 if packing is None else len(packing["tokens"]))
        if self.reuse_programs and shape not in self.programs:
            shape, packing = fitting_program(self.programs, shape, prompts) or (shape, packing)
        self.programs.add(shape)
        tokens, lens = _padded(prompts, shape.prompts, shape.prompt_len)
        out_t, out_lp, out_k, n = jax.device_get(generate_program(self._platform())(
            self.graphdef, self.state, tokens, lens, self._key(params),
            *self._sampling_args(params, stop, shape.stops), gen_len=shape.gen_len,
            group=shape.group, phases=phase_ends(shape.gen_len, self.decode_phases),
            kv_int8=self.kv_int8,
            packing=None if packing is None else jax.tree.map(jnp.asarray, packing)))
        self.last_decode_steps += int(n.max(initial=1)) - 1  # the lockstep runs to its longest
        return self._rollouts(prompts, params, stop, shape.group, out_t, out_lp, out_k, n)

    def _generate_continuous(self, prompts: list[list[int]], params: SamplingParams,
                             per_call: int) -> list[Rollout]:
        """All of a request's rows through one `_continuous_impl` program whose cache holds
        `per_call` prompts' groups, a prompt's samples started as soon as a group of rows is
        free. Shapes bucketed as a call's (prompts to `bucket_rows`, with room for the refill
        that reads past the last prompt)."""
        refill = refill_prompts(per_call)
        slots = bucket_rows(len(prompts) + refill - 1)
        tp = bucket_up(max(len(p) for p in prompts))
        stop = self._stop_ids(params)
        tokens, lens = _padded(prompts, slots, tp)
        stop_slots, gen_len = bucket_pow2(len(stop), 4), bucket_mult(params.max_tokens)
        self.continuous_shapes.add((slots, tp, gen_len, per_call, params.n, stop_slots))
        out_t, out_lp, out_k, n, steps = jax.device_get(
            generate_program(self._platform(), continuous=True)(
                self.graphdef, self.state, tokens, lens, jnp.int32(len(prompts)),
                self._key(params), *self._sampling_args(params, stop, stop_slots),
                rows=per_call * params.n, gen_len=gen_len, group=params.n, refill=refill,
                kv_int8=self.kv_int8))
        self.last_decode_steps = int(steps)
        return self._rollouts(prompts, params, stop, params.n, out_t, out_lp, out_k, n)

    @property
    def decode_programs(self) -> int:
        """How many decode programs this engine has run (compiled, or found compiled)."""
        return len(self.programs) + len(self.continuous_shapes)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        return sorted(set(() if params.ignore_eos else self.eos) | set(params.stop_token_ids))

    def _platform(self) -> str:
        return next(iter(jax.tree.leaves(self.state)[0].devices())).platform

    def _key(self, params: SamplingParams) -> jax.Array:
        seed = params.seed
        if seed is None:  # a seeded request (the probe's) leaves the unseeded stream as it was
            seed = self._seed * 1_000_003 + self._calls
            self._calls += 1
        return jax.random.key(seed)

    @staticmethod
    def _sampling_args(params: SamplingParams, stop: list[int], stop_slots: int) -> tuple:
        """temperature, top_k, top_p, full, max_new, stop_ids: a decode program's traced
        sampling arguments."""
        stop_ids = np.full((stop_slots,), -1, np.int32)
        stop_ids[: len(stop)] = stop
        return (jnp.float32(params.temperature), jnp.int32(params.top_k),
                jnp.float32(params.top_p), jnp.bool_(params.logprobs == "full"),
                jnp.int32(params.max_tokens), jnp.asarray(stop_ids))

    def _rollouts(self, prompts, params: SamplingParams, stop: list[int], group: int,
                  out_t, out_lp, out_k, n) -> list[Rollout]:
        """The rollouts of a decode program's outputs, whose row i * group + s holds sample s
        of prompt i: n samples of each prompt in order, cut at a stop string."""
        out = []
        stop_set = set(stop)
        for j in range(len(prompts) * params.n):
            r = prompts[j // params.n]
            i = j // params.n * group + j % params.n  # sample j % n of prompt j // n
            k = int(n[i])
            ids = out_t[i, :k].tolist()
            finish = "stop" if k and ids[-1] in stop_set else "length"
            cut = stop_string_cut(self.decode, ids, params.stop) if params.stop else None
            if cut is None:
                text = self.decode(ids)
            else:
                (k, text), finish = cut, "stop"
                ids = ids[:k]
            out.append(Rollout(j // params.n, r, ids, out_lp[i, :k].tolist(), text, finish,
                               self.version, kept_counts=out_k[i, :k].tolist()))
        return out

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _padded(prompts: Sequence[Sequence[int]], rows: int, length: int
            ) -> tuple[jax.Array, jax.Array]:
    """The prompts (or sequences) right-padded into [rows, length] tokens, and their lengths
    (1 past the last: a padded row runs one token)."""
    tokens = np.zeros((rows, length), np.int32)
    lens = np.ones((rows,), np.int32)
    for i, r in enumerate(prompts):
        tokens[i, : len(r)] = r
        lens[i] = len(r)
    return jnp.asarray(tokens), jnp.asarray(lens)
