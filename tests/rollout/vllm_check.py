"""Runs the vLLM engine in its own process (vLLM owns process-wide state) and prints JSON:
greedy ids, sampled ids + logprobs (plain, and under every top-p / top-k and log-prob semantics
with the kept counts), and greedy ids after an in-memory weight update."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from safetensors.torch import load_file  # noqa: E402

from rollout.engine import SamplingParams  # noqa: E402
from rollout.vllm_engine import VllmEngine  # noqa: E402

model_dir, new_weights, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
eng = VllmEngine(model_dir, max_model_len=256, enforce_eager=True)  # quick start for tests
out = {"greedy": [r.token_ids for r in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24))]}
sampled = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=7))
out["sampled"] = [(r.prompt_index, r.token_ids, r.logprobs) for r in sampled]
sampled = eng.generate(prompts, SamplingParams(temperature=0.7, max_tokens=24, n=2, seed=7))
out["sampled_t07"] = [(r.prompt_index, r.token_ids, r.logprobs) for r in sampled]
out["truncated"] = []
for semantics in ("sampled", "full"):
    for top_p in (1.0, 0.9, 0.5):
        for top_k in (0, 5, 20):
            rs = eng.generate(prompts, SamplingParams(temperature=0.7, top_p=top_p, top_k=top_k,
                                                      max_tokens=16, n=2, seed=5, logprobs=semantics))
            out["truncated"].append(((semantics, top_p, top_k),
                                     [(r.prompt_index, r.token_ids, r.logprobs, r.kept_counts) for r in rs]))
from rollout.weight_sync import probe_sequences  # noqa: E402

probe = probe_sequences(eng.llm.llm_engine.model_config.get_vocab_size())
out["probe_before"] = eng.score(probe)
metrics = eng.update_weights(load_file(new_weights), version=1)  # in memory, not from disk
out["probe_after"] = eng.score(probe)
out["probe_tolerance"] = eng.probe_tolerance
after = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
out["after"] = [r.token_ids for r in after]
out["versions"] = sorted({r.version for r in after})
out["sync"] = metrics
print("@@JSON@@" + json.dumps(out))
