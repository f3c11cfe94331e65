"""Multi-turn episodes (rollout/episodes.py): token-in/token-out alignment on both engines, the
template's prefix stability, and tools whose failures are contained and counted.

Tolerances (fp32), as tests/rollout/test_engines.py: the trainer's log-probs of sampled tokens
against the JAX engine's <= 1e-4 (same model code, reduction order differs), vLLM's <= 1e-3
(other kernels). They hold on every turn: a turn's log-probs are conditioned on the earlier
turns and the environment's tokens, so a misaligned sequence would miss them by O(1).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.data.tokenizer import load_tokenizer
from posttrain.models import from_pretrained
from rollout.engine import SamplingParams
from rollout.episodes import (
    Environment,
    Limits,
    TemplateNotPrefixStable,
    ToolEnvironment,
    ToolSpec,
    delta,
    render,
    run_episodes,
)
from posttrain.tools import calculator, format_hermes, parse_hermes
from tests.helpers import save_tiny_model_with_tokenizer

ROWS = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "What is 12 - 5?", "answer": "7"}]
# A random model rarely samples the end-of-turn token; these stop strings (in ~10% of the tiny
# vocabulary's tokens) end its turns after a few tokens, as `</tool_call>` ends a real model's,
# so that most episodes have several turns.
SP = SamplingParams(n=4, temperature=1.0, max_tokens=16, stop=tuple("aeinst"), seed=3)
LIMITS = Limits(max_turns=3, max_tokens=80, max_turn_tokens=16, seq_len=160)


class Feedback(Environment):
    """Answers every model turn with a user message (until the turn limit ends the episode)."""

    def respond(self, row, messages):
        return [{"role": "user", "content": f"Check {row['answer']} again ({len(messages)})."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("episodes")
    save_tiny_model_with_tokenizer(d)
    return d, load_tokenizer(d), from_pretrained(d)


def engine_of(kind, d, tok, model):
    if kind == "jax":
        from rollout.jax_engine import JaxEngine

        return JaxEngine(model, tok, seed=0), 1e-4
    import psutil

    from rollout.vllm_engine import VllmEngine

    # the engine shares this process with more resident memory than its share of the machine
    # (as beside a colocated trainer, or late in a test session): the KV cache must not be sized
    # as the share minus this process's memory, which is below zero (vLLM's CPU default)
    util = 0.1
    ballast = np.ones(int(util * psutil.virtual_memory().total / 8) + 2**27)
    try:
        return VllmEngine(str(d), max_model_len=256, gpu_memory_utilization=util,
                          enforce_eager=True), 1e-3
    finally:
        del ballast


@pytest.mark.parametrize("kind", ["jax", "vllm"])
def test_episode_tokens_mask_and_logprobs_align_on_every_turn(tiny, kind):
    from posttrain.algorithms.grpo import policy_logprobs
    from posttrain.rollouts import build_batch

    d, tok, model = tiny
    eng, tol = engine_of(kind, d, tok, model)
    try:
        outs = run_episodes(eng, tok, Feedback(), ROWS, SP, LIMITS)
    finally:
        getattr(eng, "shutdown", lambda: None)()
    assert len(outs) == len(ROWS) * SP.n and [o.prompt_index for o in outs] == [0] * 4 + [1] * 4
    assert sum(len(o.extra["turn_token_ids"]) > 1 for o in outs) >= 2  # multi-turn episodes
    for o in outs:
        spans, turns = o.extra["turn_spans"], o.extra["turn_token_ids"]
        ids, mask = o.token_ids, np.asarray(o.loss_mask)
        assert len(ids) == len(mask) == len(o.logprobs) == len(o.kept_counts)
        # the sequence: prompt + turn 1 as sampled + the template's delta + turn 2 + ...
        msgs = o.extra["messages"]
        assert o.prompt_token_ids == tok(render(tok, Feedback().start(ROWS[o.prompt_index]), None),
                                         add_special_tokens=False)["input_ids"]
        sampled = np.zeros(len(ids), bool)
        for (a, b), t in zip(spans, turns):
            assert ids[a:b] == t
            sampled[a:b] = True
        np.testing.assert_array_equal(mask, sampled.astype(int))  # 1 exactly on sampled tokens
        # before each turn, the sequence is the chat template on the conversation so far, and
        # the environment's tokens are the template's own tokenisation of what its messages add
        assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        assert len(assistant) == len(turns)
        for ti, ((a, _), k) in enumerate(zip(spans, assistant)):
            expect = render(tok, msgs[:k], None)
            assert tok.decode(o.prompt_token_ids + ids[:a], skip_special_tokens=False) == expect
            if ti:
                before = render(tok, msgs[:assistant[ti - 1]], None) + \
                    tok.decode(turns[ti - 1], skip_special_tokens=False)
                env_ids = tok(expect[len(before):], add_special_tokens=False)["input_ids"]
                assert ids[spans[ti - 1][1]:a] == env_ids and len(env_ids) > 0
    # the trainer's log-probs of every sampled token, on every turn, equal the engine's
    b = build_batch(outs, np.zeros(len(outs)), LIMITS.seq_len)
    logits = model(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                   jnp.asarray(b["segment_ids"])) / SP.temperature
    lp, _ = policy_logprobs(logits, jnp.asarray(b["targets"]), jnp.asarray(b["kept_counts"]),
                            SP.logprobs, SP.top_k, SP.top_p)
    on = b["loss_mask"] > 0
    assert on.sum() == sum(len(t) for o in outs for t in o.extra["turn_token_ids"])
    gap = np.abs(np.asarray(lp) - b["logp_rollout"])[on]
    assert gap.max() <= tol, gap.max()


# ---- rendering -------------------------------------------------------------------------------------
# Qwen3's rule, reduced: an assistant turn before the last user message loses its <think> block.
REWRITING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3's with enable_thinking=False, reduced: the generation prompt opens an empty <think>
# block, which the rendering of the same turn in the history leaves out.
EMPTY_THINK = REWRITING.replace("<|im_start|>assistant\\n' }}{% endif %}",
                                "<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_detected(tiny):
    d, tok, model = tiny
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    seen = render(tok, msgs, None) + "<think>add</think>4<|im_end|>"
    turn = {"role": "assistant", "content": "<think>add</think>4"}
    more = [{"role": "user", "content": "Sure?"}]
    full, text = delta(tok, seen, msgs + [turn] + more, None)  # ChatML: earlier turns verbatim
    assert full == seen + text and text.startswith("\n<|im_start|>user\nSure?")
    tok.chat_template, original = REWRITING, tok.chat_template
    try:
        with pytest.raises(TemplateNotPrefixStable, match="not prefix-stable.*character"):
            delta(tok, seen, msgs + [turn] + more, None)
        # and an episode stops at its first environment answer instead of training on a
        # sequence the model never saw
        from rollout.jax_engine import JaxEngine

        tok.chat_template = EMPTY_THINK
        with pytest.raises(TemplateNotPrefixStable, match="<think>"):
            run_episodes(JaxEngine(model, tok, seed=0), tok, Feedback(), ROWS[:1], SP, LIMITS)
    finally:
        tok.chat_template = original


# ---- tools ---------------------------------------------------------------------------------------
def test_hermes_calls_are_parsed_and_malformed_ones_named():
    text = ("Let me compute. " + format_hermes("calculator", {"expression": "37 * 48"}) +
            '<tool_call>\n{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call><tool_call>{\"name\": \"x\"")
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "37 * 48"}), ("divide", {"a": 1, "b": 2})]
    assert "not valid JSON" in calls[2].error and '"name"' in calls[3].error
    assert "not closed" in calls[4].error
    assert parse_hermes("The answer is 1776.") == []
    assert calculator("37 * 48") == "1776" and calculator("(2 + 3) / 2") == "2.5"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('id')")


def test_tool_failures_are_contained_counted_and_the_batch_goes_on(tiny):
    _, tok, _ = tiny
    tools = [ToolSpec("calculator"), ToolSpec("tests/tools_for_tests.py:divide"),
             ToolSpec("tests/tools_for_tests.py:wait"), ToolSpec("tests/tools_for_tests.py:exit_process"),
             ToolSpec("python"), ToolSpec("tests/tools_for_tests.py:lookup", {"table": {"x": 7}})]
    env = ToolEnvironment(tools, timeout_s=2.0, num_workers=2)
    try:
        turns = [format_hermes("calculator", {"expression": "37 * 48"}),
                 format_hermes("divide", {"a": 1, "b": 0}),  # raises
                 format_hermes("wait", {"seconds": 60}),  # hangs past the timeout
                 format_hermes("exit_process", {}),  # kills its worker
                 "<tool_call>{\"name\": \"calculator\", </tool_call>",  # malformed
                 format_hermes("search", {"q": "x"}),  # unknown
                 format_hermes("python", {"code": "print(6 * 7)"}),  # the OS sandbox as a tool
                 "The answer is 7.",  # no call: the final answer
                 format_hermes("divide", {"a": 9, "b": 3}),  # after all that, tools still run
                 format_hermes("lookup", {"key": "x"})]  # with the recipe's bound argument
        convs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in turns]
        out = env.respond_batch([{}] * len(turns), convs)
        text = [o[0]["content"] if o else None for o in out]
        assert text[0] == "1776" and out[0][0]["role"] == "tool" and out[0][0]["name"] == "calculator"
        assert text[1].startswith("error: ZeroDivisionError")
        assert text[2].startswith("error: no result within 2s")
        assert text[3] == "error: the tool's worker process died"
        assert text[4].startswith("error: the tool call is not valid JSON")
        assert text[5].startswith("error: no tool named 'search'")
        assert text[6] == "42\n" and text[7] is None and text[8] == "3.0" and text[9] == "7"
        assert env.metrics() == {"tools/calls": 9.0, "tools/malformed": 1.0, "tools/unknown": 1.0,
                                 "tools/errors": 2.0, "tools/timeouts": 1.0}
        # the schemas the template shows come from type hints and docstrings
        assert [t["function"]["name"] for t in env.tools] == ["calculator", "divide", "wait",
                                                              "exit_process", "python", "lookup"]
        assert list(env.tools[5]["function"]["parameters"]["properties"]) == ["key"]
        assert env.tools[1]["function"]["parameters"]["properties"]["b"] == {
            "type": "number", "description": "the divisor"}
        assert '"name": "calculator"' in render(tok, convs[0][:1], env.tools)
    finally:
        env.close()


def test_an_environment_from_a_file_runs_episodes_and_a_bad_one_is_named(tiny):
    from posttrain.config import RunConfig
    from posttrain.errors import UserError
    from posttrain.rollouts import make_environment
    from rollout.jax_engine import JaxEngine

    _, tok, model = tiny
    cfg = RunConfig.model_validate({"agent": {
        "environment": "tests/environments_for_tests.py:TryAgain",
        "environment_kwargs": {"hint": "No. Once more."}}})
    env = make_environment(cfg)
    outs = run_episodes(JaxEngine(model, tok, seed=0), tok, env, ROWS, SP, LIMITS)
    said = [m["content"] for o in outs for m in o.extra["messages"] if m["role"] == "user"]
    assert "No. Once more." in said  # a random model is wrong, so it is told to try again
    bad = RunConfig.model_validate({"agent": {
        "environment": "tests/environments_for_tests.py:NotAnEnvironment"}})
    with pytest.raises(UserError, match="not a subclass of rollout.episodes.Environment"):
        make_environment(bad)
