"""`posttrain generate`: completions from a checkpoint with either engine, one JSON line each."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from posttrain.errors import UserError


def find_tokenizer_dir(model: Path) -> Path:
    for cand in (model, model / "tokenizer", model / "hf", model.parent / "tokenizer",
                 model.parent.parent / "tokenizer"):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise UserError(f"{model}: no tokenizer found in or next to the model")


def run_generate(args) -> int:
    from posttrain.models.loading import resolve_model_path
    from posttrain.data.tokenizer import load_tokenizer
    from rollout.engine import SamplingParams

    model_dir = resolve_model_path(args.model)
    tok = load_tokenizer(find_tokenizer_dir(model_dir))
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        p = Path(args.prompts)
        if not p.is_file():
            raise UserError(f"--prompts {p}: no such file")
        prompts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line.rstrip("\n")
                   for line in p.read_text().splitlines() if line.strip()]
    if args.chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": x}], tokenize=False,
                                         add_generation_prompt=True) for x in prompts]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        ids = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
    sp = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed, logprobs=args.logprobs)
    # Engines (vLLM) log to stdout; keep stdout for the JSON lines only.
    import os

    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        rollouts = _generate(args, model_dir, tok, ids, sp)
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    for r in rollouts:
        sys.stdout.write(json.dumps({"prompt": prompts[r.prompt_index], "completion": r.text,
                                     "token_ids": r.token_ids, "logprobs": r.logprobs,
                                     "kept_counts": r.kept_counts,
                                     "finish_reason": r.finish_reason}) + "\n")
    return 0


def _generate(args, model_dir: Path, tok, ids, sp):
    if args.engine == "jax":
        from posttrain.models import from_pretrained
        from rollout.jax_engine import JaxEngine

        engine = JaxEngine(from_pretrained(model_dir), tok)
    else:
        from rollout.vllm_engine import VllmEngine

        hf_dir = model_dir
        if not (model_dir / "config.json").is_file():  # an Orbax checkpoint: export once
            from posttrain.models.export import save_hf
            from posttrain.models import from_pretrained

            hf_dir = Path(tempfile.mkdtemp(prefix="posttrain-generate-"))
            save_hf(from_pretrained(model_dir), hf_dir)
            tok.save_pretrained(hf_dir)
        engine = VllmEngine(str(hf_dir), max_model_len=args.max_model_len)
    return engine.generate(ids, sp)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate completions with the jax or vllm engine")
    g.add_argument("--model", required=True, help="HF directory, run directory or Orbax checkpoint")
    g.add_argument("--engine", choices=["jax", "vllm"], default="jax")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts", help="file: one prompt per line, or JSONL with a 'prompt' field")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--logprobs", choices=("sampled", "full"), default="sampled",
                   help="log-probs of the truncated distribution sampled from, or of the whole "
                        "softmax (differ only under --top-p / --top-k)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM context length (default: the model's)")
    g.set_defaults(fn=run_generate)
