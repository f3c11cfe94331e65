"""Logits parity with transformers (torch, fp32) on tiny random models built in the test.

Tolerance 1e-4 absolute: both sides compute in fp32 with the same reduction order up to XLA vs
ATen matmul blocking; observed differences are ~1e-6 on logits of magnitude ~1.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models import KVCache, from_pretrained
from tests.helpers import assert_padded_logits_match, save_tiny_hf_model, torch_logits

TOL = 1e-4
CASES = [
    ("qwen3", dict(tie=True, heads=4, kv=2)),
    ("qwen3", dict(tie=False, heads=4, kv=4)),
    ("qwen3", dict(tie=True, heads=8, kv=2)),
    ("qwen3", dict(tie=False, heads=4, kv=1)),
    ("llama3", dict(tie=True, heads=4, kv=2, rope_scaling=True)),
    ("llama3", dict(tie=False, heads=8, kv=4, rope_scaling=True)),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-" + "-".join(f"{k}{v}" for k, v in c[1].items()))
def pair(request, tmp_path_factory):
    arch, kw = request.param
    path = tmp_path_factory.mktemp("hf")
    ref = save_tiny_hf_model(path, arch, **kw)
    return ref, path


@pytest.mark.parametrize("scan", [True, False])
def test_padded_batch_matches_transformers(pair, scan):
    ref, path = pair
    ours = from_pretrained(path, scan_layers=scan)
    assert_padded_logits_match(ref, ours, [37, 20, 5], 40, TOL)


def test_packed_row_matches_each_segment_alone(pair):
    ref, path = pair
    ours = from_pretrained(path)
    rng = np.random.default_rng(1)
    seg_lens = [11, 17, 8]
    ids = np.concatenate([rng.integers(3, 256, n) for n in seg_lens] + [np.zeros(4, np.int64)])
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(seg_lens)] + [np.zeros(4)])
    pos = np.concatenate([np.arange(n) for n in seg_lens] + [np.arange(4)])
    got = np.asarray(ours(jnp.asarray(ids[None], jnp.int32), jnp.asarray(pos[None], jnp.int32),
                          jnp.asarray(seg[None], jnp.int32)))[0]
    start = 0
    for n in seg_lens:
        want = torch_logits(ref, ids[None, start:start + n])[0]
        np.testing.assert_allclose(got[start:start + n], want, atol=TOL, rtol=0)
        start += n


@pytest.mark.parametrize("scan", [True, False])
def test_kv_cache_decode_matches_full_forward(pair, scan):
    """Prefill a prompt, then feed the rest token by token through the cache (stacked per-layer
    buffers when scanned, one buffer per layer when unrolled)."""
    _, path = pair
    ours = from_pretrained(path, scan_layers=scan)
    rng = np.random.default_rng(2)
    # Two rows of different prompt lengths, right-padded, decoded in lockstep.
    full = rng.integers(3, 256, (2, 24)).astype(np.int32)
    prompt_len = np.array([9, 14])
    want = np.asarray(ours(jnp.asarray(full)))
    cache = KVCache.init(ours.cfg, batch=2, max_len=32)
    t0 = prompt_len.max()
    seg = (np.arange(t0)[None] < prompt_len[:, None]).astype(np.int32)
    logits, cache = ours(jnp.asarray(full[:, :t0]), jnp.broadcast_to(jnp.arange(t0), (2, t0)),
                         jnp.asarray(seg), cache=cache)
    for i, n in enumerate(prompt_len):
        np.testing.assert_allclose(np.asarray(logits)[i, :n], want[i, :n], atol=TOL, rtol=0)
    # Decode: row i is at position prompt_len[i] + step (one compiled step, as engines run it).
    decode = nnx.jit(lambda m, tok, pos, c: m(tok, pos, jnp.ones((2, 1), jnp.int32), cache=c))
    for step in range(24 - t0):
        pos = (prompt_len + step)[:, None].astype(np.int32)
        tok = full[np.arange(2)[:, None], pos]
        logits, cache = decode(ours, jnp.asarray(tok), jnp.asarray(pos), cache)
        for i in range(2):
            np.testing.assert_allclose(np.asarray(logits)[i, 0], want[i, pos[i, 0]], atol=TOL, rtol=0)
