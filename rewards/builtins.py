"""Built-in reward functions, all with the batch signature fn(prompts, completions, **columns).

- `math_reward`: math-verify equivalence of the final answer (\\boxed{} or an answer tag) with the
  ground-truth column (`answer` by default).
- `format_reward`: a regex, or well-formed <think>...</think><answer>...</answer> tags.
- `exact_match_reward`: the extracted answer equals the ground truth after whitespace stripping.
- `length_reward`: DAPO's soft overlong penalty, in tokens.
- `code_reward`: runs the completion's code against test cases in `posttrain.sandbox`.
"""

from __future__ import annotations

import re

from posttrain.sandbox import DEFAULT_ISOLATION, run_many


def completion_text(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):  # chat messages
        return str(c[-1].get("content", ""))
    return str(c)


def extract_answer(text: str, answer_tag: str | None = None) -> str | None:
    """The last \\boxed{...} (balanced braces), else the last <tag>...</tag>, else None."""
    if answer_tag:
        found = re.findall(rf"<{answer_tag}>(.*?)</{answer_tag}>", text, flags=re.S)
        if found:
            return found[-1].strip()
    start = text.rfind("\\boxed{")
    if start >= 0:
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    return None


def _truths(columns: dict, key: str, n: int) -> list:
    if key not in columns:
        raise KeyError(f"column {key!r} (the ground truth) is missing from the dataset; "
                       f"available: {sorted(columns)}")
    return list(columns[key])


def math_reward(prompts, completions, *, answer_column: str = "answer", answer_tag: str | None = None,
                fallback_last_number: bool = False, **columns) -> list[float]:
    from math_verify import parse, verify

    truths = _truths(columns, answer_column, len(completions))
    out = []
    for c, truth in zip(completions, truths):
        text = completion_text(c)
        ans = extract_answer(text, answer_tag)
        if ans is None and fallback_last_number:
            nums = re.findall(r"-?\d+(?:\.\d+)?(?:/\d+)?", text)
            ans = nums[-1] if nums else None
        if ans is None:
            out.append(0.0)
            continue
        gold = parse(str(truth) if "\\" in str(truth) or "$" in str(truth) else f"${truth}$")
        pred = parse(f"${ans}$")
        out.append(1.0 if pred and gold and verify(gold, pred) else 0.0)
    return out


THINK_ANSWER = re.compile(r"^\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*$",
                          flags=re.S)


def format_reward(prompts, completions, *, pattern: str | None = None, **columns) -> list[float]:
    """1.0 when the completion matches `pattern` (searched), or, by default, is exactly one
    <think>...</think> block followed by one non-empty <answer>...</answer> block."""
    match = re.compile(pattern, flags=re.S).search if pattern else THINK_ANSWER.match
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


def exact_match_reward(prompts, completions, *, answer_column: str = "answer",
                       answer_tag: str | None = None, **columns) -> list[float]:
    truths = _truths(columns, answer_column, len(completions))
    out = []
    for c, t in zip(completions, truths):
        text = completion_text(c)
        ans = extract_answer(text, answer_tag)
        out.append(1.0 if (ans if ans is not None else text).strip() == str(t).strip() else 0.0)
    return out


def length_reward(prompts, completions, *, max_tokens: int, buffer_tokens: int,
                  completion_ids=None, **columns) -> list[float]:
    """DAPO soft overlong punishment: 0 up to max - buffer, then linear down to -1 at max, -1 beyond.

    R(L) = 0 if L <= Lmax - Lbuf;  ((Lmax - Lbuf) - L) / Lbuf if Lmax - Lbuf < L <= Lmax;  -1 else.
    """
    if completion_ids is None:
        raise KeyError("column 'completion_ids' is required by the length reward")
    out = []
    for ids in completion_ids:
        n, start = len(ids), max_tokens - buffer_tokens
        out.append(0.0 if n <= start else ((start - n) / buffer_tokens if n <= max_tokens else -1.0))
    return out


CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", flags=re.S)


def extract_code(text: str) -> str:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def code_reward(prompts, completions, *, tests_column: str = "tests", timeout_s: float = 5.0,
                memory_mb: int = 512, isolation: str = DEFAULT_ISOLATION, parallel: int | None = None,
                **columns) -> list[float]:
    """Fraction of the row's tests passed. A test is an assert statement (MBPP style) or a
    {"input": stdin, "output": expected stdout} pair. Each completion runs in its own OS sandbox
    (`posttrain.sandbox`; `isolation: process` is the weaker fallback), `parallel` at a time
    (default: one per core), with `timeout_s` of wall time for all its tests."""
    tests = _truths(columns, tests_column, len(completions))
    codes = [extract_code(completion_text(c)) for c in completions]
    results = run_many(codes, tests, parallel=parallel, timeout_s=timeout_s, memory_mb=memory_mb,
                       isolation=isolation)
    return [r.fraction_passed for r in results]
