"""The pure train step: gradient accumulation equals the full batch; state is donated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.models import build_model
from posttrain.train.step import TrainState, make_train_step, next_token_loss
from tests.models.test_sharding_remat import CFG, batch


def run(grad_accum):
    b = jax.tree.map(jnp.asarray, batch(b=8))
    # uneven token counts per micro-batch: accumulation must divide by the global count
    b["loss_mask"] = b["loss_mask"].at[:4, 10:].set(0.0)
    graphdef, params, rest = nnx.split(build_model(CFG), nnx.Param, ...)
    opt = optax.sgd(1.0)  # the update is minus the gradient: compare gradients through params
    step = jax.jit(make_train_step(graphdef, opt, next_token_loss, grad_accum), donate_argnums=0)
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    new, m = step(state, b)
    return new, m


def test_grad_accumulation_equals_full_batch():
    full, m1 = run(1)
    acc, m4 = run(4)
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    assert float(m4["tokens"]) == float(m1["tokens"])
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert int(acc.step) == 1
