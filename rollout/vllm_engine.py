"""vLLM as a rollout engine, in this process, with weights written in place after each update.

The engine is a `vllm.LLM` over an HF directory (ours: `converters.export.save_hf`). After an
update, new tensors go straight into the loaded model through
`llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=...))`
-- never a reload from disk -- then the prefix cache is reset so no stale KV is reused. Logprobs
are vLLM's `processed_logprobs`: those of the distribution actually sampled from. On GPUs with
the trainer in another process, vLLM's own weight-transfer engines (NCCL / IPC) take this role.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import numpy as np

from rollout.engine import Rollout, SamplingParams

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the model reachable in-process


class VllmEngine:
    def __init__(self, model_dir: str, *, dtype: str = "float32", gpu_memory_utilization: float = 0.15,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, seed: int = 0,
                 version: int = 0, enforce_eager: bool = False,
                 enable_expert_parallel: bool = False):
        from vllm import LLM

        self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                       enable_prefix_caching=True,
                       **({"enable_expert_parallel": True} if enable_expert_parallel else {}))
        self.tokenizer = self.llm.get_tokenizer()
        self.version = version

    def update_weights(self, weights: Mapping[str, object], version: int) -> dict[str, float]:
        """`weights`: HF tensor name -> array (numpy, torch, or JAX: taken through DLPack, no copy
        on CPU)."""
        import torch

        t0 = time.perf_counter()
        tensors = [(name, _to_torch(arr)) for name, arr in weights.items()]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)

        def load(worker):
            worker.model_runner.reload_weights(weights_iterator=iter(tensors))
            _refresh_embedding_gemms(worker.model_runner.get_model())

        with torch.no_grad():
            self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()
        self.version = version
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        # Incremental detokenization is per-token Python in vLLM's output loop: only stop strings
        # need it; otherwise the texts are decoded here in one batch. Logprobs come flat (one
        # list per request instead of a dict per token).
        detok = bool(params.stop)
        sp = VSP(n=params.n, temperature=params.temperature, top_p=params.top_p,
                 top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_tokens,
                 stop_token_ids=list(params.stop_token_ids), stop=list(params.stop),
                 seed=params.seed, logprobs=0, flat_logprobs=True, detokenize=detok,
                 ignore_eos=params.ignore_eos)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids],
                                 sp, use_tqdm=False)
        done = [(i, c) for i, out in enumerate(outs) for c in out.outputs]
        texts = ([c.text for _, c in done] if detok else
                 self.tokenizer.batch_decode([list(c.token_ids) for _, c in done],
                                             skip_special_tokens=True))
        rollouts = []
        for (i, c), text in zip(done, texts):
            ids = list(c.token_ids)
            rollouts.append(Rollout(i, list(prompt_token_ids[i]), ids, _sampled_logprobs(c.logprobs, ids),
                                    text, "stop" if c.finish_reason == "stop" else "length",
                                    self.version))
        return rollouts


def _sampled_logprobs(flat, ids: list[int]) -> list[float]:
    """The sampled token's logprob at each position of a `FlatLogprobs` (logprobs=0: vLLM keeps
    exactly the sampled token per position)."""
    if not flat:
        return []
    out = []
    for pos, tok in enumerate(ids):
        j = flat.start_indices[pos]
        if flat.token_ids[j] != tok:
            raise RuntimeError(f"vLLM logprob at position {pos} is for token {flat.token_ids[j]}, "
                               f"not the sampled {tok}")
        out.append(float(flat.logprobs[j]))
    return out


def _refresh_embedding_gemms(model) -> None:
    """vLLM's CPU backend prepacks the embedding matrix for its use as a tied LM head
    (`UnquantizedEmbeddingMethod.process_weights_after_loading`), and `reload_weights` does not
    redo it: a tied model would keep computing logits with the old embedding. Redo it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)


def _to_torch(arr):
    import torch

    if isinstance(arr, torch.Tensor):
        return arr
    if isinstance(arr, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(arr))
    try:  # a JAX array: zero-copy through DLPack on CPU
        return torch.utils.dlpack.from_dlpack(arr)
    except Exception:
        return torch.from_numpy(np.asarray(arr).copy())
