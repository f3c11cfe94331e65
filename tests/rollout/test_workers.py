"""Ray rollout workers: two of each engine kind serve one batch; a worker killed mid-batch is
replaced and its requests retried, none lost or duplicated; weights reach every worker."""

import threading
import time

import pytest
import ray

from posttrain.models import from_pretrained
from rollout.engine import SamplingParams
from rollout.jax_engine import JaxEngine
from rollout.weight_sync import hf_numpy
from rollout.worker import WorkerGroup
from tests.helpers import save_tiny_model_with_tokenizer

PROMPTS = [[5 + i] * (3 + i) for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("workers")
    save_tiny_model_with_tokenizer(d, "qwen3")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    yield d
    ray.shutdown()


def spec(kind, d):
    if kind == "jax":
        return {"kind": "jax", "model_dir": str(d), "tokenizer_dir": str(d)}
    return {"kind": "vllm", "model_dir": str(d),
            "vllm": {"max_model_len": 512, "gpu_memory_utilization": 0.15, "enforce_eager": True}}


@pytest.mark.slow
# JAX workers: the group's kill recovery is the same code for every engine kind; vLLM workers
# serve the disaggregated vLLM GRPO runs of tests/test_grpo_e2e.py
@pytest.mark.parametrize("kind", ["jax"])
def test_two_workers_serve_a_batch_and_survive_a_kill(model_dir, kind):
    group = WorkerGroup(spec(kind, model_dir), num_workers=2)
    try:
        assert len({ray.get(w.pid.remote()) for w in group.workers}) == 2
        greedy = SamplingParams(temperature=0, max_tokens=16)
        out = group.generate(PROMPTS, greedy)
        from posttrain.data.tokenizer import load_tokenizer

        local = JaxEngine(from_pretrained(model_dir), load_tokenizer(model_dir))
        assert [r.prompt_index for r in out] == list(range(8))
        assert [r.token_ids for r in out] == [r.token_ids for r in local.generate(PROMPTS, greedy)]

        # weights through the object store: every worker confirms the version
        model = from_pretrained(model_dir)
        group.update_weights(hf_numpy(__import__("flax").nnx.state(model), model.cfg), version=3)
        assert group.versions() == [3, 3]

        # kill worker 0 while the batch is in flight
        # long enough to be in flight when the kill lands (vLLM is ~10x faster than our JAX engine
        # inside a 1-CPU actor)
        sampled = SamplingParams(n=16, temperature=1.0, max_tokens=400 if kind == "vllm" else 96, seed=5)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("out", group.generate(PROMPTS, sampled)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "the batch finished before the kill: not a mid-batch failure"
        victim = group.workers[0]
        ray.kill(victim)
        t.join(timeout=600)
        out = result["out"]
        assert group.restarts >= 1 and group.workers[0] is not victim
        assert sorted(r.prompt_index for r in out) == sorted(list(range(8)) * 16)
        assert {r.version for r in out} == {3}  # the replacement got the latest weights
    finally:
        group.shutdown()


@pytest.mark.slow
def test_replaced_worker_sits_out_until_the_next_bucketed_sync(model_dir):
    """Bucketed transports keep no copy of the weights: a worker killed after a sync is replaced,
    its requests go to the worker that serves the current version, and the replacement joins at
    the next sync. A group with no such worker left says so instead of serving old weights."""
    from flax import nnx

    from rollout.weight_sync import push

    model = from_pretrained(model_dir)
    group = WorkerGroup(spec("jax", model_dir), num_workers=2)
    try:
        push([group], nnx.state(model), model.cfg, 1, transport="object_store")
        ray.kill(group.workers[0])
        out = group.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
        assert sorted(r.prompt_index for r in out) == list(range(8))
        assert {r.version for r in out} == {1} and group.stale == {0}
        push([group], nnx.state(model), model.cfg, 2, transport="collective")
        assert group.stale == set() and group.versions() == [2, 2]
    finally:
        group.shutdown()
    solo = WorkerGroup(spec("jax", model_dir), num_workers=1)
    try:
        push([solo], nnx.state(model), model.cfg, 1, transport="object_store")
        ray.kill(solo.workers[0])
        with pytest.raises(RuntimeError, match="no rollout worker serves weights version 1"):
            solo.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    finally:
        solo.shutdown()


@pytest.mark.slow
def test_a_hung_worker_is_replaced_and_its_prompts_sent_again(model_dir, capsys):
    """A worker that stops answering without dying (SIGSTOP: Ray still sees a live actor, as
    with a wedged kernel or a deadlock) is detected after `request_timeout_s`, killed and
    replaced; its prompts go out again: every prompt answered once, the same greedy tokens."""
    import os
    import re
    import signal

    group = WorkerGroup(spec("jax", model_dir), num_workers=2)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16)
        want = group.generate(PROMPTS, greedy)  # both workers compiled: only the hang is slow
        group.request_timeout_s = 5.0
        hung = group.pids[0]
        os.kill(hung, signal.SIGSTOP)
        capsys.readouterr()
        out = group.generate(PROMPTS, greedy)
        warned = capsys.readouterr().err
        assert group.restarts == 1 and group.pids[0] != hung, (group.restarts, warned)
        m = re.search(rf"rollout worker 0 \(pid {hung}\) has not answered 4 prompts in (\d+) s", warned)
        # detected at the timeout: 1 s polls, plus slack for a loaded machine
        assert m and 5 <= int(m.group(1)) <= 10, warned
        assert [r.prompt_index for r in out] == list(range(8))  # none lost, none twice
        assert [r.token_ids for r in out] == [r.token_ids for r in want]
        assert _gone(hung, 60), f"the hung worker {hung} was left running"
    finally:
        try:
            os.kill(hung, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        group.shutdown()


def _gone(pid: int, within_s: float) -> bool:
    """The process has exited (a zombie not yet reaped counts: it runs nothing)."""
    from pathlib import Path

    deadline = time.time() + within_s
    while time.time() < deadline:
        status = Path(f"/proc/{pid}/status")
        try:
            if "State:\tZ" in status.read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False
