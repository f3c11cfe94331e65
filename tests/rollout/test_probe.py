"""The probe check after every weight sync: an engine that serves the trainer's weights passes,
one that kept old weights, took one tensor stale or one in the wrong layout (a reshape where a
transpose belonged, the classic converter bug) is stopped with an
error naming it -- in process, in Ray workers, and in a GRPO run on its first step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.models import from_pretrained
from posttrain.train.step import TrainState, make_train_step, next_token_loss
from rollout.jax_engine import JaxEngine, score_sequences
from rollout.weight_sync import WeightSyncError, check_probe, hf_numpy, probe_sequences, push
from tests.helpers import save_tiny_model_with_tokenizer, with_lora


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The model as saved, and the trainer's after one SGD step (the weights a sync delivers)."""
    d = tmp_path_factory.mktemp("probe")
    save_tiny_model_with_tokenizer(d, "qwen3")
    ours = from_pretrained(d)
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
    tokens = jnp.asarray([[5, 17, 99, 200, 33] * 4])
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, 1), "positions": jnp.arange(20)[None],
             "segment_ids": jnp.ones((1, 20), jnp.int32), "loss_mask": jnp.ones((1, 20))}
    opt = optax.sgd(0.5)
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    state, _ = jax.jit(make_train_step(graphdef, opt, next_token_loss))(state, batch)
    return d, nnx.merge(graphdef, state.params, state.frozen)


PROBE = probe_sequences(512, seed=0)


def test_probe_is_fixed_and_spans_the_vocabulary():
    assert PROBE == probe_sequences(512, seed=0) != probe_sequences(512, seed=1)
    assert len(PROBE) == 4 and all(len(s) == 24 for s in PROBE)
    assert 0 <= min(map(min, PROBE)) and max(map(max, PROBE)) < 512


def test_synced_engine_passes_and_a_stale_one_is_named(models):
    d, trained = models
    eng = JaxEngine(from_pretrained(d))
    with pytest.raises(WeightSyncError, match=r"JaxEngine .* version 0: probe log-prob gap"):
        check_probe([eng], trained, PROBE, 0)  # still the saved weights
    m = push([eng], nnx.state(trained), trained.cfg, 1, probe=PROBE, model=trained)
    # same model code on both sides and the same weights: the scores are bitwise equal; the
    # sampling path (prefill + cached decode) computes the same in other shapes (fp32 order)
    assert m["sync/probe_gap"] == 0.0 and m["sync/gbps"] > 0
    assert m["sync/probe_sampled_gap"] <= 1e-4


def _hf_with(trained, edit):
    weights = hf_numpy(nnx.state(trained), trained.cfg)
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name] = edit(weights[name], name)
    return weights


def wrong_layout(w, name):
    return np.ascontiguousarray(w.reshape(w.shape[::-1]).T)  # same shape, scrambled


@pytest.mark.parametrize("what", ["one tensor stale", "one tensor in the wrong layout"])
def test_one_wrong_tensor_is_caught(models, what):
    d, trained = models
    saved = hf_numpy(nnx.state(from_pretrained(d)), trained.cfg)
    edit = (lambda w, name: saved[name]) if what == "one tensor stale" else wrong_layout
    eng = JaxEngine(from_pretrained(d))
    eng.update_weights(_hf_with(trained, edit), 1)  # the version is right, the weights are not
    with pytest.raises(WeightSyncError, match="version 1"):
        check_probe([eng], trained, PROBE, 1)


def test_scores_are_teacher_forced_logprobs(models):
    """Independent check of what the probe measures: log_softmax of a plain forward."""
    _, trained = models
    got = score_sequences(trained, PROBE[:2])
    ids = jnp.asarray(PROBE[:2])
    logp = jax.nn.log_softmax(trained(ids), -1)
    want = np.take_along_axis(np.asarray(logp[:, :-1]), np.asarray(ids)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@pytest.mark.slow
def test_ray_workers_prove_their_weights(models):
    import ray

    from rollout.worker import WorkerGroup

    d, trained = models
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    group = WorkerGroup({"kind": "jax", "model_dir": str(d), "scan_layers": True}, 2)
    try:
        m = push([group], nnx.state(trained), trained.cfg, 1, probe=PROBE, model=trained)
        assert m["sync/probe_gap"] <= 1e-4 and m["sync/probe_sampled_gap"] <= 1e-4
        # worker 1 loads a wrong tensor; worker 0 the right weights
        ray.get(group.workers[1].update_weights.remote(
            _hf_with(trained, wrong_layout), 1))
        with pytest.raises(WeightSyncError, match=r"rollout worker 1 \(jax\)"):
            check_probe([group], trained, PROBE, 1)
    finally:
        group.shutdown()
        ray.shutdown()


def config(run_dir):
    from posttrain.config import RunConfig

    return RunConfig.model_validate({
        "algorithm": "grpo", "run_dir": str(run_dir),
        "model": {"config": {"arch": "qwen3", "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 1, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 32}},
        "data": {"source": "generated", "seq_len": 64,
                 "generated": {"num_train": 64, "num_eval": 8, "max_operand": 9}},
        "optimizer": {"learning_rate": 1e-2, "warmup_steps": 0},
        "train": {"steps": 2},
        "grpo": {"group_size": 4, "prompts_per_step": 2, "max_tokens": 4},  # 8 rows: 8 devices
        "eval": {"num_problems": 2},
        "rewards": {"functions": [{"fn": "tests/rewards_for_tests.py:first_token_parity"}]},
        "tracking": {"wandb": {"enabled": False}}})


def test_grpo_run_with_a_stale_engine_stops_on_the_first_step(tmp_path, monkeypatch):
    """The engine confirms every version but never installs the weights: the run stops at the
    first sync, naming the engine, instead of training on rollouts of the initial policy."""
    from posttrain.pipeline import run_grpo
    from tests.train.e2e import metrics

    def keeps_old_weights(self, weights, version):
        self.version = version
        return {"sync/bytes": 0.0, "sync/seconds": 0.0}

    # the control: the same run with working syncs passes every probe (8 sharded devices)
    run_grpo(config(tmp_path / "ok"), tmp_path / "ok")
    gaps = [m["sync/probe_gap"] for m in metrics(tmp_path / "ok") if "sync/probe_gap" in m]
    assert len(gaps) == 2 and max(gaps) <= 1e-4
    monkeypatch.setattr(JaxEngine, "update_weights", keeps_old_weights)
    with pytest.raises(WeightSyncError, match=r"JaxEngine \(in process\) does not serve the "
                                              r"trainer's weights after the sync to version 1"):
        run_grpo(config(tmp_path / "stale"), tmp_path / "stale")
    assert not (tmp_path / "stale" / "checkpoints" / "1").exists()  # nothing trained on stale rollouts


def test_grpo_run_whose_engine_samples_without_the_adapters_stops_on_the_first_sync(
        tmp_path, monkeypatch):
    """A LoRA GRPO run on the colocated JAX engine whose sampling path skips the adapters (the
    fault its prefill had): the teacher-forced probe passes every sync, the sampling probe stops
    the run at the first sync after the adapters moved (version 1: they start at B = 0),
    naming the engine, before any checkpoint of a policy trained on such rollouts. Unrolled
    layers: the engine then runs the trainer's adapters as they are (a scanned trainer's are
    merged into the engine's kernels, `layer_unstacker`)."""
    from posttrain.pipeline import run_grpo

    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={
        "scan_layers": False,
        "lora": cfg.model.lora.model_copy(update={"rank": 4, "alpha": 8.0})})})
    break_the_decode(monkeypatch)
    with pytest.raises(WeightSyncError, match=r"JaxEngine \(in process\) samples from another "
                                              r"policy than the trainer's after the sync to version 1"):
        run_grpo(cfg, tmp_path)
    assert not (tmp_path / "checkpoints" / "1").exists()


@pytest.mark.parametrize("int8_base", [False, True])
def test_lora_policy_reaches_an_hf_engine_as_effective_weights(models, int8_base):
    """A LoRA policy (optionally over an int8 base) exported under HF names is the weight it
    computes with, W + (alpha / r) A B: an engine that loads it passes the probe against the
    LoRA trainer; one given the base weights alone (adapters dropped) is caught."""
    d, _ = models
    policy = with_lora(from_pretrained(d, scan_layers=False), int8_base)
    state, cfg = nnx.state(policy), policy.cfg
    eng = JaxEngine(from_pretrained(d))
    eng.update_weights(hf_numpy(state, cfg, lora_scale=8.0 / 4), 1)
    m = check_probe([eng], policy, PROBE, 1)
    assert m["sync/probe_gap"] <= 1e-4 and m["sync/probe_sampled_gap"] <= 1e-4
    with pytest.raises(ValueError, match="lora_scale"):
        hf_numpy(state, cfg)
    if not int8_base:  # the adapters left out: the base weights alone
        eng.update_weights(hf_numpy(nnx.state(from_pretrained(d, scan_layers=False)), cfg), 2)
        with pytest.raises(WeightSyncError, match="version 2"):
            check_probe([eng], policy, PROBE, 2)


def without_adapters(state: nnx.State, graphdef) -> nnx.State:
    """`state` with every LoRA adapter zeroed: the base model's weights alone."""
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new variables, same arrays
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var[...] = jnp.zeros_like(var[...])
    return nnx.state(model)


def break_the_decode(monkeypatch):
    """A fault confined to the JAX engine's sampling path: generation runs without the LoRA
    adapters (what the prefill did when it ran outside the model's call), while the engine's
    teacher-forced score still has them."""
    from rollout import jax_engine

    real = jax_engine.generate_program
    monkeypatch.setattr(jax_engine, "generate_program", lambda platform: (
        lambda graphdef, state, *a, **k: real(platform)(
            graphdef, without_adapters(state, graphdef), *a, **k)))


@pytest.mark.parametrize("int8_base", [False, True])
def test_colocated_lora_engine_samples_from_the_trainers_policy(models, int8_base):
    """The colocated JAX engine runs the trainer's LoRA modules (adapters trained: B != 0): the
    log-probs of what it samples (plain and packed prefill, repeated cache, phased decode) equal
    the trainer's re-score at fp32 level. Before the prefill went through the model's call it
    ran without the adapters (gap 0.27; an int8 base crashed)."""
    d, _ = models
    policy = with_lora(from_pretrained(d, scan_layers=False), int8_base)
    eng = JaxEngine(policy)
    for version in (0, 1):  # the plain prefill and the packed one (`sampling_request`)
        m = check_probe([eng], policy, PROBE, version)
        assert m["sync/probe_gap"] == 0.0 and m["sync/probe_sampled_gap"] <= 1e-4


def test_a_decode_path_fault_passes_the_teacher_forced_probe_and_is_caught(models, monkeypatch):
    d, _ = models
    policy = with_lora(from_pretrained(d, scan_layers=False))
    eng = JaxEngine(policy)
    break_the_decode(monkeypatch)
    for version in (2, 3):  # the plain prefill and the packed one
        # the probe before the sampling path: scores teacher-forced only, sees nothing wrong
        assert check_probe([eng], policy, PROBE, version, sampling=False)["sync/probe_gap"] == 0.0
        with pytest.raises(WeightSyncError, match=r"JaxEngine \(in process\) samples from another "
                                                  r"policy than the trainer's after the sync to "
                                                  f"version {version}"):
            check_probe([eng], policy, PROBE, version)


class LevelTwoSleeper(JaxEngine):
    """A JAX engine with vLLM's level-2 sleep: the weights are dropped on sleep (their memory
    is given away: zeros here) and stay whatever that memory holds after the wake, until a sync
    rewrites them."""

    calls: list

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.state = jax.tree.map(jnp.zeros_like, self.state)

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags or ())))


def test_an_engine_that_slept_is_synced_and_probed_after_every_wake(models):
    """The pipeline's `sync_engine` after a sleeping update: wake the weights, sync, wake the KV
    cache, probe. An engine that woke without the sync (the failure a peer shipped: garbage
    served after wake) is stopped by the probe."""
    from posttrain.pipeline import sync_engine

    d, trained = models
    eng = LevelTwoSleeper(from_pretrained(d))
    eng.calls = []
    opts = dict(probe=PROBE, model=trained)
    eng.sleep(2)
    m = sync_engine(eng, nnx.state(trained), trained.cfg, 1, 2, opts)
    assert eng.calls == [("sleep", 2), ("wake", ("weights",)), ("wake", ("kv_cache",))]
    assert m["sync/probe_gap"] == 0.0 and eng.version == 1 and "sync/probe_seconds" in m
    eng.sleep(2)
    eng.wake_up()
    with pytest.raises(WeightSyncError, match="LevelTwoSleeper .* version 1"):
        check_probe([eng], trained, PROBE, 1)


def test_fp32_weights_on_a_tpu_get_the_bf16_bound_unless_matmuls_run_at_fp32(models, monkeypatch):
    """On a TPU an fp32 matmul at the default precision is one bf16 pass: the engine's
    sampling path and the trainer's re-score then differ at the bf16 level (0.0125 measured on a
    v5e), so the fp32 bound (1e-4) would stop every run there; at `highest` it holds again."""
    import rollout.jax_engine as je

    d, _ = models
    eng = JaxEngine(from_pretrained(d))
    assert eng.probe_tolerance == 1e-4  # fp32 weights on this CPU
    monkeypatch.setattr(je.jax, "default_backend", lambda: "tpu")
    with jax.default_matmul_precision("default"):  # the suite runs at highest (conftest)
        assert eng.probe_tolerance == 5e-2
    with jax.default_matmul_precision("highest"):
        assert eng.probe_tolerance == 1e-4


def test_the_probe_samples_in_the_rollouts_program_and_still_catches_a_stale_engine(models):
    """With `rollout.reuse_programs` (on by default on accelerators) the probe's sampling
    requests, both versions' shapes, run in the decode program the rollouts compiled (16
    prompts x 4 samples here): no program of their own, the checks unchanged -- a synced
    engine passes and a stale one is named."""
    from rollout.engine import SamplingParams

    d, trained = models
    eng = JaxEngine(from_pretrained(d), reuse_programs=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, int(rng.integers(10, 30))).tolist() for _ in range(16)]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=1)
    eng.generate(prompts, sp)  # a step's rollouts
    assert len(eng.programs) == 1
    push([eng], nnx.state(trained), trained.cfg, 1, probe=PROBE, model=trained)
    push([eng], nnx.state(trained), trained.cfg, 2, probe=PROBE, model=trained)
    assert len(eng.programs) == 1
    eng.update_weights(nnx.state(from_pretrained(d)), 3)  # the old weights again
    with pytest.raises(WeightSyncError, match="version 3"):
        check_probe([eng], trained, PROBE, 3)


def test_every_probe_request_is_scored_in_one_program(models):
    """The probe's teacher-forced sequences and both kinds of sampled re-scores (even and odd
    versions: `rollout.engine.sampling_request`) run one scoring program per model: on a TPU each
    further shape was a compile of 7-22 s in a cold run's first steps."""
    from rollout.engine import PROBE_NEW_TOKENS, sampling_request
    from rollout.jax_engine import _score

    _, trained = models
    _score.clear_cache()
    requests = [PROBE]
    for version in (0, 1):
        prompts, sp = sampling_request(PROBE, version)
        requests.append([p + [7] * sp.max_tokens for p in prompts for _ in range(sp.n)])
    assert max(len(s) for r in requests for s in r) == 14 + PROBE_NEW_TOKENS
    for r in requests:
        assert len(score_sequences(trained, r)) == len(r)
    assert _score._cache_size() == 1


def test_a_scanned_lora_policy_is_merged_once_per_kernel_for_the_engines_twin(models):
    """`layer_unstacker` merges a scanned LoRA policy's adapters for the engine's unrolled twin
    in one batched product per adapted kernel, not one per layer (merged layer by layer, the
    0.6B policy's program held 596 fusions and compiled for a v5e in 67 s; 43 and 2.7 s now),
    and each layer's kernel is still W + (alpha / r) A B of that layer's slices (numpy)."""
    from posttrain.models.transformer import layer_unstacker

    d, _ = models
    policy = with_lora(from_pretrained(d, scan_layers=True))
    _, state = nnx.split(policy)
    _, unstack = layer_unstacker(policy.cfg, lora_scale=2.0)
    assert str(jax.make_jaxpr(unstack)(state)).count("dot_general") == 3  # q, v, down
    twin = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(unstack(state))}
    flat = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
    layers = policy.cfg.num_hidden_layers
    assert layers > 1
    at = ("model", "layers", "self_attn", "q_proj")
    for i in range(layers):
        w, a, b = (flat[at + (k,)][i] for k in ("kernel", "kernel_lora_a", "kernel_lora_b"))
        want = w.astype(np.float64) + 2.0 * a.astype(np.float64) @ b.astype(np.float64)
        got = twin[("model", "layers", i, "self_attn", "q_proj", "kernel")]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
