"""int8 quantization-aware training through qwix.

Forward tolerance: int8 per-channel weights and per-token activations carry ~0.4% relative error
per matmul (1/255 of the range); over 2 layers the logits move by a few percent of their scale.
We require max |logits_int8 - logits_fp32| <= 5% of max |logits_fp32|, and that training lowers the
loss.
"""

import jax
import jax.numpy as jnp
import optax
import qwix
from flax import nnx

from posttrain.models import build_model
from posttrain.train.step import TrainState, make_train_step, next_token_loss
from tests.models.test_sharding_remat import CFG, batch


def quantized(model, x):
    provider = qwix.QtProvider([qwix.QtRule(module_path=r".*_proj", weight_qtype=jnp.int8,
                                            act_qtype=jnp.int8)])
    return qwix.quantize_model(model, provider, x)


def test_int8_forward_close_to_fp32():
    b = batch()
    x = jnp.asarray(b["tokens"])
    ref = build_model(CFG)(x)
    q = quantized(build_model(CFG), x)(x)
    err = float(jnp.abs(q - ref).max())
    assert 0 < err <= 0.05 * float(jnp.abs(ref).max()), err  # really quantized, and close


def test_int8_qat_trains():
    b = jax.tree.map(jnp.asarray, batch())
    model = quantized(build_model(CFG), b["tokens"])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(3e-3)
    step = jax.jit(make_train_step(graphdef, opt, next_token_loss))
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    losses = []
    for _ in range(30):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
