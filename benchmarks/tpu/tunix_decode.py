"""The peer of `benchmarks.tpu.decode`: Tunix 0.1.7's vanilla sampler on the same shapes and chip.

    PYTHONPATH=$TUNIX_PATH:$PYTHONPATH python -m benchmarks.tpu.tunix_decode --shapes 128x128+128,... [--tiny]

Run by `benchmarks.tpu.decode --peer tunix` in a process of its own after ours (only this process
gets Tunix on its path; one process holds the chip at a time). For each BATCHxPROMPT+NEW: Tunix's
own Qwen3 (`tunix.models.qwen3`, the 0.6B preset, random weights, bf16 parameters and compute,
XLA attention: its splash path cannot prefill into its sampler's cache, see `tunix_grpo`), its
`tunix.generate.sampler.Sampler` with a bf16 KV cache of PROMPT + NEW slots, BATCH prompts of
exactly PROMPT random token ids, temperature 1 over the whole vocabulary (`top_p=1.0`, its
sampling fast path: a categorical draw, no sort), log-probs returned, no stop token (an id
outside the vocabulary). The tokenizer is an identity over space-separated ids: the prompts go
in as the token ids ours decodes, and tokenizing is host work outside the per-step difference.
Timing as ours: (t(NEW) - t(1)) / (NEW - 1), medians of 3 calls after a compiling call of each.
Prints `@@` + JSON per shape. `--tiny`: a tiny model on CPU (the dry run).
"""

from __future__ import annotations

import argparse
import json
import time


class IdTokenizer:
    """Tunix's tokenizer protocol (`encode`, `decode`, `bos_id`, `eos_id`, `pad_id`) over
    space-separated token ids: no BOS (its sampler prepends one when `bos_id` is truthy)."""

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return 0


def run_shape(shape: str, tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.generate import sampler as sampler_lib

    from benchmarks.tpu.decode import parse_config, per_step_seconds
    from benchmarks.tpu.tunix_sft import tunix_qwen3

    _, b, p, new, _ = parse_config(f"0.6b:{shape}")
    model, cfg, mesh = tunix_qwen3(tiny, 4096, jnp.bfloat16, "NONE")
    cfg.use_flash_attention = False  # read at call time: XLA attention for prefill and decode
    rng = np.random.default_rng(0)
    prompts = [" ".join(map(str, rng.integers(1, cfg.vocab_size, p))) for _ in range(b)]
    with mesh:
        sampler = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
            cache_size=p + new, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim))

        def gen(steps: int):
            return sampler(prompts, max_generation_steps=steps, max_prompt_length=p,
                           temperature=1.0, top_p=1.0, top_k=None, return_logprobs=True,
                           eos_tokens=[cfg.vocab_size], seed=0)

        t0 = time.perf_counter()
        out = gen(new)
        compile_s = time.perf_counter() - t0
        gen(1)
        if min(len(t) for t in out.tokens) != new or len(out.logprobs[0]) != new:
            raise RuntimeError("Tunix's sampler stopped before NEW tokens")
        t_new, t_one, step_s = per_step_seconds(gen, new)
    dev = jax.devices()[0]
    return {"peer": "tunix", "shape": shape, "batch": b, "prompt": p, "new": new,
            "compile_s": compile_s, "generate_s": t_new, "prefill_s": t_one,
            "step_ms": step_s * 1e3, "tokens_per_s": b / step_s,
            "peak_bytes": (dev.memory_stats() or {}).get("peak_bytes_in_use"),
            "device": str(dev.device_kind)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True, help="BATCHxPROMPT+NEW,...")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        try:
            res = run_shape(shape, args.tiny)
        except Exception as e:  # one shape out of memory must not hide the others
            res = {"peer": "tunix", "shape": shape, "error": f"{type(e).__name__}: {e}"[-1500:]}
        print("@@" + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
