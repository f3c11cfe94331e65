"""Packing on hand-built examples: which positions carry loss, and no crossing of segments."""

import jax.numpy as jnp
import numpy as np

from posttrain.data.packing import bucket_down, bucket_up, pack_rows, packed_rows
from posttrain.models import ModelConfig, build_model
from posttrain.train.step import next_token_loss


def test_hand_built_pack():
    ex = [([5, 6, 7], [1, 1, 1]), ([8, 9], [0, 1]), ([10, 11, 12, 13], [1, 1, 1, 1])]
    b, used = pack_rows(ex, rows=2, seq_len=6)
    assert used == 3
    np.testing.assert_array_equal(b["tokens"], [[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 0, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    # position t predicts token t+1 of the same segment; the loss mask follows the predicted token
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(b["targets"][0, :2], [6, 7])


def test_example_that_does_not_fit_is_not_consumed():
    ex = [([1] * 4, [1] * 4), ([2] * 4, [1] * 4), ([3] * 4, [1] * 4)]
    b, used = pack_rows(ex, rows=1, seq_len=6)
    assert used == 1 and b["tokens"][0].tolist() == [1, 1, 1, 1, 0, 0]


def test_packed_loss_equals_unpacked_per_sequence():
    model = build_model(ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, head_dim=16))
    rng = np.random.default_rng(0)
    ex = [(rng.integers(3, 64, n).tolist(), [1] * n) for n in (7, 5, 9)]
    packed, _ = pack_rows(ex, rows=1, seq_len=24)
    s_packed, n_packed, _ = next_token_loss(model, {k: jnp.asarray(v) for k, v in packed.items()})
    total_s, total_n = 0.0, 0.0
    for e in ex:
        single, _ = pack_rows([e], rows=1, seq_len=24)
        s, n, _ = next_token_loss(model, {k: jnp.asarray(v) for k, v in single.items()})
        total_s, total_n = total_s + float(s), total_n + float(n)
    assert float(n_packed) == total_n == 7 + 5 + 9 - 3
    np.testing.assert_allclose(float(s_packed), total_s, rtol=1e-5)


def test_first_fit_fills_earlier_rows_and_consumes_a_prefix():
    # next fit would close row 0 at the 4-token example and leave 3 columns empty; first fit
    # puts the later 2-token example there. It stops at the first example that fits nowhere
    # (the 5), even though the 1 after it would fit: a batch consumes a prefix of the data.
    ex = [([1] * 4, [1] * 4), ([2] * 4, [1] * 4), ([3] * 2, [1] * 2), ([4] * 5, [1] * 5),
          ([5], [1])]
    b, used = pack_rows(ex, rows=2, seq_len=6)
    assert used == 3
    np.testing.assert_array_equal(b["tokens"], [[1, 1, 1, 1, 3, 3], [2, 2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0]])
    # next fit: row 0 is closed by the second example; the 2 follows it in row 1, the 5 ends it
    b, used = pack_rows(ex, rows=2, seq_len=6, first_fit=False)
    assert used == 3
    np.testing.assert_array_equal(b["tokens"], [[1, 1, 1, 1, 0, 0], [2, 2, 2, 2, 3, 3]])
    # without packing: one example per row, in order
    b, used = pack_rows(ex, rows=2, seq_len=6, pack=False)
    assert used == 2 and b["tokens"][:, 0].tolist() == [1, 2] and b["segment_ids"].max() == 1


def test_shape_ladder_bounds_what_compiles():
    """Every length a run pads to is a ladder point: 14 sizes up to 4096 tokens (multiples of
    32 would be 128), at most 1.5x padding past the dense part, and the shared prefix rounds
    down onto the same ladder."""
    ups = sorted({bucket_up(n) for n in range(1, 4097)})
    assert ups == [32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    for n in range(1, 4097):
        b = bucket_up(n)
        assert b >= n and (n <= 128 or b < 1.5 * n)
        d = bucket_down(n, 16)
        assert d <= n and (d == 0 or d == bucket_up(d, 16)) and bucket_up(d + 1, 16) > n
    assert bucket_down(15, 16) == 0 and bucket_down(500, 16) == 384
    # packed rows: the row count (in units of B / 8, a multiple of row_unit) is a ladder point
    for n_long in range(0, 129, 7):
        rows = packed_rows([60] * n_long + [4] * (128 - n_long), 64, 2)
        assert len(rows) % 2 == 0 and len(rows) == bucket_up(len([r for r in rows if r]), 16)
