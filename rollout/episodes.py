"""Multi-turn episodes: the policy writes a turn, an environment answers (tool results, feedback),
the policy writes the next, until the environment ends the episode or a limit does.

Token in, token out. An episode is one growing token sequence:

    prompt (the chat template on the first messages, generation prompt included)
    + turn 1 as sampled                                           trained on (loss mask 1)
    + the environment's answer as a token delta of the template   context    (loss mask 0)
    + turn 2 as sampled ...

The engine's tokens are never re-tokenised: each model turn's token ids, log-probs and kept
counts go into the training batch as the engine returned them. After a turn the conversation
(earlier messages, the model's turn decoded verbatim, the environment's new messages) is rendered
by the chat template with the generation prompt; the text the model has already been given plus
its own turn must be a prefix of that rendering (the template is prefix-stable there), and only
the rest, the delta, is tokenised and appended. A template that rewrites earlier turns (Qwen3's
drops the `<think>` of past turns, others strip whitespace) would make the trainer see a sequence
the model never saw; `TemplateNotPrefixStable` says where instead.

Every round generates the next turn of every unfinished episode in one engine call (the first
round G samples per prompt, then one continuation per episode), so both engines and both
placements batch as they do for single-turn rollouts.

An environment (`Environment`) gives an episode's first messages from its dataset row and
answers each model turn with new messages, or None to end it. `ToolEnvironment` is the common
case: the recipe's tools, called in the model's syntax (`posttrain.tools`), run in worker
processes (`rewards.pool.ToolPool`: per-call timeout, a raise or hang becomes an error message
to the model and a count, never a stopped batch); a turn without a call ends the episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from posttrain.errors import UserError
from rollout.engine import Rollout, SamplingParams
from posttrain.tools import PARSERS, ToolCall, resolve_tool, tool_schema


class TemplateNotPrefixStable(UserError):
    """The chat template renders earlier turns differently once later ones exist."""


# ---- environments --------------------------------------------------------------------------------
class Environment:
    """One episode per dataset row. Subclass and override `respond` (or `respond_batch`, to
    batch across the round's episodes); `tools` lists the tool schemas (or functions) the chat
    template shows the model. A user environment is named in the recipe as
    `agent.environment: path/to/file.py:ClassName` and built with `agent.environment_kwargs`."""

    tools: list | None = None

    def start(self, row: dict) -> list[dict]:
        """The first messages: the row's `prompt` (text or messages)."""
        prompt = row.get("prompt")
        if prompt is None and "messages" in row:
            prompt = [m for m in row["messages"] if m["role"] != "assistant"]
        if not prompt:
            raise UserError("a multi-turn row needs a 'prompt' (text or messages)")
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def respond(self, row: dict, messages: list[dict]) -> list[dict] | None:
        """After a model turn (the last message): new messages, or None to end the episode."""
        return None

    def respond_batch(self, rows: list[dict], conversations: list[list[dict]]) -> list:
        return [self.respond(r, m) for r, m in zip(rows, conversations)]

    def metrics(self) -> dict[str, float]:
        """Counts since the start (e.g. tool errors), reported with every step."""
        return {}

    def close(self) -> None:
        pass


@dataclass
class ToolSpec:
    fn: str  # built-in name, module:function or file.py:function
    kwargs: dict = field(default_factory=dict)  # bound arguments the model does not see
    name: str | None = None  # as the model calls it (default: the function's name)


class ToolEnvironment(Environment):
    """The model calls tools; each call's result comes back as a `tool` message. A turn with no
    call is the final answer. A malformed call (`posttrain.tools` parser), an unknown tool, a tool
    that raises or hangs: the model reads an error message in the tool's place, and it is
    counted (`tools/malformed`, `tools/unknown`, `tools/errors`, `tools/timeouts`)."""

    COUNTS = ("calls", "malformed", "unknown", "errors", "timeouts")

    def __init__(self, tools: Sequence[ToolSpec], parser: str = "hermes", timeout_s: float = 10.0,
                 num_workers: int = 2, max_calls_per_turn: int = 4, max_result_chars: int = 2000):
        from rewards.pool import ToolPool

        if parser not in PARSERS:
            raise UserError(f"agent.parser: {parser!r} is not one of {sorted(PARSERS)}")
        self.parse = PARSERS[parser]
        self.specs: dict[str, ToolSpec] = {}
        self.tools = []
        for t in tools:
            f = resolve_tool(t.fn)
            schema = tool_schema(f, t.fn, tuple(t.kwargs))
            name = t.name or schema["function"]["name"]
            schema["function"]["name"] = name
            if name in self.specs:
                raise UserError(f"agent.tools: two tools are called {name!r} (set `name`)")
            self.specs[name] = t
            self.tools.append(schema)
        self.max_calls, self.max_chars = max_calls_per_turn, max_result_chars
        self.pool = ToolPool(num_workers, timeout_s)
        self.counts = dict.fromkeys(self.COUNTS, 0)

    def respond_batch(self, rows, conversations):
        calls_of = [self.parse(conv[-1]["content"])[: self.max_calls] for conv in conversations]
        runnable = [(i, j, c) for i, calls in enumerate(calls_of) for j, c in enumerate(calls)
                    if c.error is None and c.name in self.specs]
        done = self.pool.run([(self.specs[c.name].fn, self.specs[c.name].kwargs, c.arguments)
                              for _, _, c in runnable])
        results = {(i, j): r for (i, j, _), r in zip(runnable, done)}
        out = []
        for i, calls in enumerate(calls_of):
            if not calls:
                out.append(None)  # no call: the model's final answer
                continue
            out.append([self._message(c, results.get((i, j))) for j, c in enumerate(calls)])
        return out

    def _message(self, call: ToolCall, result: tuple[str, str] | None) -> dict:
        self.counts["calls"] += 1
        if call.error is not None:
            self.counts["malformed"] += 1
            text = f"error: {call.error}"
        elif result is None:
            self.counts["unknown"] += 1
            text = f"error: no tool named {call.name!r} (tools: {', '.join(self.specs)})"
        else:
            status, text = result
            if status != "ok":
                self.counts["errors" if status == "error" else "timeouts"] += 1
                text = f"error: {text}"
        return {"role": "tool", "name": call.name or "", "content": text[: self.max_chars]}

    def metrics(self):  # totals since the start, as the reward pool's counts
        return {f"tools/{k}": float(v) for k, v in self.counts.items()}

    def close(self):
        self.pool.close()


# ---- rendering -------------------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], tools) -> str:
    """The conversation as the model is given it, generation prompt included."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=True)


def delta(tokenizer, seen: str, messages: list[dict], tools) -> tuple[str, str]:
    """(the full rendering, the part of it after `seen`): what the environment's messages add.
    Raises `TemplateNotPrefixStable` when the rendering does not start with `seen`."""
    full = render(tokenizer, messages, tools)
    if not full.startswith(seen):
        at = next((k for k, (a, b) in enumerate(zip(seen, full)) if a != b), min(len(seen), len(full)))
        raise TemplateNotPrefixStable(
            "the chat template is not prefix-stable: rendering the conversation after a model "
            f"turn changes text the model was already given, at character {at}: "
            f"{seen[max(0, at - 30):at + 30]!r} became {full[max(0, at - 30):at + 30]!r}. Training "
            "on the re-rendered sequence would train on tokens the model never saw; use a "
            "template that keeps earlier turns verbatim (for Qwen3, one that keeps past "
            "<think> blocks), or a single-turn recipe")
    return full, full[len(seen):]


# ---- episodes --------------------------------------------------------------------------------------
@dataclass
class Limits:
    max_turns: int = 4  # model turns per episode
    max_tokens: int = 256  # completion tokens per episode, model and environment together
    max_turn_tokens: int = 64  # per model turn (grpo.max_tokens)
    seq_len: int | None = None  # prompt + completion never longer (the training row)


@dataclass
class Episode:
    row: dict
    messages: list[dict]
    prompt_ids: list[int]
    seen: str  # the text of prompt_ids + ids (what the model has been given so far)
    ids: list[int] = field(default_factory=list)  # completion: model and environment tokens
    mask: list[int] = field(default_factory=list)  # 1 on model tokens
    logprobs: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    turns: list[list[int]] = field(default_factory=list)  # each model turn's token ids
    spans: list[tuple[int, int]] = field(default_factory=list)  # each turn's [start, end) in ids
    version: int | None = None
    finish: str | None = None  # stop | length | max_turns | max_tokens
    env_tokens: int = 0

    def budget(self, lim: Limits) -> int:
        left = lim.max_tokens - len(self.ids)
        if lim.seq_len is not None:
            left = min(left, lim.seq_len - len(self.prompt_ids) - len(self.ids))
        return min(lim.max_turn_tokens, left)


def _turn_end_ids(tokenizer) -> set[int]:
    end = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        end.add(im_end)
    return {e for e in end if e is not None}


def run_episodes(engine, tokenizer, env: Environment, rows: list[dict], sp: SamplingParams,
                 lim: Limits) -> list[Rollout]:
    """`sp.n` episodes per row, grouped like `engine.generate`'s rollouts (episode i * n + j is
    sample j of row i); each returned `Rollout` holds the whole episode (see the module doc)."""
    ends = _turn_end_ids(tokenizer)
    episodes = []
    for row in rows:
        messages = env.start(row)
        seen = render(tokenizer, messages, env.tools)
        ids = tokenizer(seen, add_special_tokens=False)["input_ids"]
        episodes += [Episode(row, list(messages), ids, seen) for _ in range(sp.n)]
    live = list(range(len(episodes)))
    rnd = 0
    while live:
        budget = max(episodes[i].budget(lim) for i in live)
        seed = None if sp.seed is None else sp.seed + 7919 * rnd
        if rnd == 0:  # G samples of each prompt, one engine call
            outs = engine.generate([episodes[i * sp.n].prompt_ids for i in range(len(rows))],
                                   replace(sp, max_tokens=budget, seed=seed))
        else:
            outs = engine.generate([episodes[i].prompt_ids + episodes[i].ids for i in live],
                                   replace(sp, n=1, max_tokens=budget, seed=seed))
        for i, out in zip(live, outs):
            _take_turn(episodes[i], out, lim, ends, tokenizer)
        asking = [i for i in live if episodes[i].finish is None]
        answers = env.respond_batch([episodes[i].row for i in asking],
                                    [episodes[i].messages for i in asking]) if asking else []
        for i, new in zip(asking, answers):
            _take_answer(episodes[i], new, lim, tokenizer, env.tools)
        live = [i for i in live if episodes[i].finish is None]
        rnd += 1
    return [_as_rollout(k // sp.n, e) for k, e in enumerate(episodes)]


def _take_turn(e: Episode, out: Rollout, lim: Limits, ends: set[int], tokenizer) -> None:
    """The model's turn as sampled, cut to the episode's own budget. A turn is complete when
    the engine stopped it (the end-of-turn token, or a stop string such as `</tool_call>`: then
    the template's end of turn comes with the environment's delta); one cut by a length limit
    ends the episode."""
    take = e.budget(lim)
    ids = list(out.token_ids[:take])
    cut = len(out.token_ids) > take
    e.spans.append((len(e.ids), len(e.ids) + len(ids)))
    e.ids += ids
    e.mask += [1] * len(ids)
    e.logprobs += list(out.logprobs[: len(ids)])
    e.kept += list(out.kept_counts[: len(ids)]) if out.kept_counts else [0] * len(ids)
    e.turns.append(ids)
    e.version = out.version if e.version is None else min(e.version, out.version)
    eot = bool(ids) and ids[-1] in ends
    content = tokenizer.decode(ids[:-1] if eot else ids, skip_special_tokens=False)
    e.messages.append({"role": "assistant", "content": content})
    e.seen += tokenizer.decode(ids, skip_special_tokens=False)
    if cut or out.finish_reason != "stop" or not ids:
        e.finish = "length"


def _take_answer(e: Episode, new: list[dict] | None, lim: Limits, tokenizer, tools) -> None:
    if not new:
        e.finish = "stop"
        return
    if len(e.turns) >= lim.max_turns:  # the environment would go on: the limit ends it
        e.finish = "max_turns"
        return
    full, text = delta(tokenizer, e.seen, e.messages + list(new), tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    e.messages += list(new)
    if len(e.ids) + len(ids) >= lim.max_tokens or (
            lim.seq_len is not None and len(e.prompt_ids) + len(e.ids) + len(ids) >= lim.seq_len):
        e.finish = "max_tokens"  # no room for another model turn after it: left out
        return
    e.ids += ids
    e.mask += [0] * len(ids)
    e.logprobs += [0.0] * len(ids)
    e.kept += [0] * len(ids)
    e.env_tokens += len(ids)
    e.seen = full


def _as_rollout(prompt_index: int, e: Episode) -> Rollout:
    last = next((m["content"] for m in reversed(e.messages) if m["role"] == "assistant"), "")
    return Rollout(
        prompt_index=prompt_index, prompt_token_ids=e.prompt_ids, token_ids=e.ids,
        logprobs=e.logprobs, text=last,
        finish_reason="stop" if e.finish == "stop" else "length", version=e.version or 0,
        kept_counts=e.kept, loss_mask=e.mask,
        extra={"messages": e.messages, "turn_token_ids": e.turns, "turn_spans": e.spans,
               "ended_by": e.finish,
               "env_tokens": e.env_tokens,
               "tool_calls": sum(m["role"] == "tool" for m in e.messages)})


def episode_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Turns, tool calls, limits and the model/environment token split, per episode."""
    import numpy as np

    ex = [r.extra for r in rollouts if "turn_token_ids" in r.extra]
    if not ex:
        return {}
    env = np.array([x["env_tokens"] for x in ex])
    model = np.array([sum(map(len, x["turn_token_ids"])) for x in ex])
    return {"episodes/turns": float(np.mean([len(x["turn_token_ids"]) for x in ex])),
            "episodes/tool_calls": float(np.mean([x["tool_calls"] for x in ex])),
            "episodes/with_tool_call": float(np.mean([x["tool_calls"] > 0 for x in ex])),
            "episodes/ended_by_limit": float(np.mean([x["ended_by"] != "stop" for x in ex])),
            "episodes/model_tokens": float(model.mean()), "episodes/env_tokens": float(env.mean())}


def trajectory_columns(rollouts: list[Rollout]) -> dict[str, list]:
    """What a reward function sees of each episode besides its final answer (`completions`)."""
    return {"messages": [r.extra["messages"] for r in rollouts],
            "turn_token_ids": [r.extra["turn_token_ids"] for r in rollouts],
            "num_tool_calls": [r.extra["tool_calls"] for r in rollouts]}

