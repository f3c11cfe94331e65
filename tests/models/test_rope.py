"""RoPE's two ways to its cos/sin (`layers.rope_tables`): a table looked up where there are many
positions, computed at each position in a decode step. The engine's prefill takes the first and
its decode the second, so they must agree to the bit; a position past the table is NaN."""

import jax.numpy as jnp
import numpy as np

from posttrain.models import ModelConfig
from posttrain.models.layers import rope_inv_freq, rope_tables


def test_table_and_direct_paths_give_the_same_bits_and_out_of_range_is_nan():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    inv = rope_inv_freq(cfg)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 96, (4, 1)), jnp.int32)
    direct = rope_tables(pos, inv, 96)  # 4 positions < 96 rows: computed directly
    table = rope_tables(jnp.tile(pos, (1, 32)), inv, 96)  # 128 positions: looked up
    assert direct.cos.shape == (4, 1, 1, 32)
    for a, b in zip(direct, table):
        np.testing.assert_array_equal(np.asarray(a)[:, 0], np.asarray(b)[:, 0])
    past = rope_tables(jnp.full((4, 32), 96, jnp.int32), inv, 96)
    assert np.isnan(np.asarray(past.cos)).all() and np.isnan(np.asarray(past.sin)).all()
