"""vLLM as a rollout engine, in this process, with weights written in place after each update.

The engine is a `vllm.LLM` over an HF directory (ours: `posttrain.models.export.save_hf`). After an
update, new tensors go straight into the loaded model through
`llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=...))`
-- never a reload from disk -- then the prefix cache is reset so no stale KV is reused. Built with
`weight_transfer="ipc" | "nccl"`, the engine instead runs its model in worker processes of its
own (vLLM's engine core and executor: how it runs on GPUs, tensor parallel included) and takes
weights through vLLM's weight-transfer engine of that name (`rollout.vllm_transfer`);
`sleep` / `wake_up` free its GPU memory during the trainer's update.

Log-probs follow the call's semantics (`SamplingParams.logprobs`), and each token carries the
kept count (how many tokens top-k / top-p left) that the trainer replays. vLLM's own
`logprobs_mode` cannot give both: `processed_logprobs` is the truncated distribution, and
`raw_logprobs` is taken before temperature (the full softmax only at temperature 1), and neither
reports the kept set. So the engine runs in `processed_logprobs` mode and `_install_semantics`
wraps two pieces of the worker's sampler (vLLM 0.32's `Sampler.topk_topp_sampler` and
`Sampler.gather_logprobs`): the first also returns the temperature-scaled full log-softmax when
"full" is asked for and counts the finite processed log-probs (the kept set), the second puts
that count in the slot vLLM fills with the sampled token's rank (`logprobs=0` asks for no
other). The sampling itself is untouched.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import numpy as np

from rollout.buckets import Digest
from rollout.engine import Rollout, SamplingParams

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the model reachable in-process


MIN_VLLM = (0, 32)


def require_weight_transfer() -> None:
    """vLLM's weight-transfer engines (0.32 and later), or a clear error."""
    import vllm

    version = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: F401
    except ImportError:
        version = (0, 0)
    if version < MIN_VLLM:
        raise RuntimeError(f"rollout.transport vllm_ipc / vllm_nccl use vLLM's weight-transfer "
                           f"engines (vllm.distributed.weight_transfer, vLLM >= "
                           f"{'.'.join(map(str, MIN_VLLM))}); this is vLLM {vllm.__version__}")


def cpu_kv_cache(gpu_memory_utilization: float) -> dict:
    """On the CPU platform, the KV cache as an explicit size: `gpu_memory_utilization` of the
    machine's memory. Left to itself, vLLM's CPU worker gives the cache that share *minus this
    process's resident memory*, which, with the engine in the trainer's process (colocated, or
    a long test session), is below zero and refuses to start. (VLLM_CPU_KVCACHE_SPACE, where a
    user set it, still wins: vLLM's CPU platform applies it over this.)"""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    import psutil

    return {"kv_cache_memory_bytes": int(gpu_memory_utilization * psutil.virtual_memory().total)}


class VllmEngine:
    def __init__(self, model_dir: str, *, dtype: str = "float32", gpu_memory_utilization: float = 0.15,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, seed: int = 0,
                 version: int = 0, enforce_eager: bool = False,
                 enable_expert_parallel: bool = False, weight_transfer: str | None = None,
                 enable_sleep_mode: bool = False):
        from vllm import LLM

        extra = {"enable_expert_parallel": True} if enable_expert_parallel else {}
        if weight_transfer is not None:
            require_weight_transfer()
            # the model in processes of vLLM's own; the sampler wrap below and the CPU refresh
            # after a transfer reach them as functions through collective_rpc
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            extra["weight_transfer_config"] = {"backend": weight_transfer}
        if enable_sleep_mode:
            extra["enable_sleep_mode"] = True
        extra.update(cpu_kv_cache(gpu_memory_utilization))
        self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                       enable_prefix_caching=True, **extra)
        self.weight_transfer, self.tensor_parallel_size = weight_transfer, tensor_parallel_size
        self.asleep = False
        self.tokenizer = self.llm.get_tokenizer()
        self.version = version
        # probe gap still meaning "same weights": fp32, other kernels than the trainer's (1e-3,
        # as for sampled log-probs); bf16 engines round every activation to 8 bits of mantissa
        self.probe_tolerance = 1e-3 if dtype == "float32" else 1e-1
        self.llm.collective_rpc(_install_semantics)
        self._full = False
        self.weight_dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    weight_layout = "hf"
    copies_on_load = False  # layerwise reload may keep a layer's tensors until it is complete

    def update_weights(self, weights: Mapping[str, object], version: int) -> dict[str, float]:
        """`weights`: HF tensor name -> array (numpy, torch, or JAX: taken through DLPack, no copy
        on CPU)."""
        t0 = time.perf_counter()
        nbytes = self.load_all(weights.items(), version)
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    def load_all(self, tensors, version: int, check_digest: bool = False) -> int:
        """A whole update in one call into the engine (start, load, finish): for tensors that
        cost nothing to hold at once (views of the trainer's buffers)."""
        import torch

        tensors = [(name, _to_torch(arr)) for name, arr in tensors]
        self._digest = Digest().update(tensors) if check_digest else None

        def reload(worker):
            _start_reload(worker)
            worker.model_runner.get_model().load_weights(iter(tensors))
            _finish_reload(worker)

        with torch.no_grad():
            self.llm.collective_rpc(reload)
        self._serve(version)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def start_weight_update(self, version: int, check_digest: bool = False) -> None:
        """Begin a streamed update, as vLLM's own weight-transfer engines do: layerwise reload
        state initialized, then `load_weights` per bucket, `finish_weight_update` processes
        the loaded layers (repacking for the CPU kernels included)."""
        self._digest = Digest() if check_digest else None
        self.llm.collective_rpc(_start_reload)

    def load_weights(self, tensors, layout: str = "hf", borrow: bool = False) -> int:
        import torch

        if layout != "hf":
            raise ValueError(f"vLLM loads HF-layout tensors, not {layout!r}")
        tensors = [(name, _to_torch(arr)) for name, arr in tensors]
        if self._digest is not None:
            self._digest.update(tensors)

        def load(worker):
            worker.model_runner.get_model().load_weights(iter(tensors))

        with torch.no_grad():
            self.llm.collective_rpc(load)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def finish_weight_update(self, version: int) -> str | None:
        import torch

        with torch.no_grad():
            self.llm.collective_rpc(_finish_reload)
        return self._serve(version)

    # ---- vLLM's weight-transfer engine (`rollout.vllm_transfer`): its four calls ----
    def init_transfer(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_transfer(self) -> None:
        self._digest = None  # vLLM's engines do not hash what they load; the probe checks
        self.llm.start_weight_update()

    def update_transfer(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_transfer(self, version: int) -> str | None:
        self.llm.finish_weight_update(str(version))
        self.llm.collective_rpc(_after_reload)
        return self._serve(version)

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes (they hold this process's stdout
        open; a process that exits with os._exit would otherwise leave them running)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    # ---- sleep mode: the engine's GPU memory freed while the trainer updates ----
    def sleep(self, level: int) -> None:
        """Level 1: weights offloaded to host memory, KV cache dropped; level 2: both dropped
        (the next sync rewrites every weight anyway). Until `wake_up` and a sync proven by the
        probe, the engine serves nothing."""
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """`tags`: ["weights"] first (then sync), ["kv_cache"] after; None: both."""
        self.llm.wake_up(tags=tags)
        self.asleep = tags is not None and "kv_cache" not in tags
        self.llm.reset_prefix_cache()

    def _serve(self, version: int) -> str | None:
        self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused
        self.version = version
        self.last_digest = self._digest.hexdigest() if self._digest is not None else None
        return self.last_digest

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence's tokens after the first (vLLM's prompt
        log-probs: the raw full softmax, no temperature), for the probe check."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], sp,
                                 use_tqdm=False)
        scores = []
        for s, out in zip(sequences, outs):
            pl = out.prompt_logprobs
            scores.append([float(pl[t][tok].logprob) for t, tok in enumerate(s) if t > 0])
        return scores

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        # Incremental detokenization is per-token Python in vLLM's output loop: only stop strings
        # need it; otherwise the texts are decoded here in one batch. Logprobs come flat (one
        # list per request instead of a dict per token).
        detok = bool(params.stop)
        if (params.logprobs == "full") != self._full:
            self._full = params.logprobs == "full"
            self.llm.collective_rpc(_set_full_logprobs, args=(self._full,))
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
            lps, kept = _sampled_logprobs(c.logprobs, ids)
            rollouts.append(Rollout(i, list(prompt_token_ids[i]), ids, lps, text,
                                    "stop" if c.finish_reason == "stop" else "length",
                                    self.version, kept_counts=kept))
        return rollouts


def _sampled_logprobs(flat, ids: list[int]) -> tuple[list[float], list[int]]:
    """The sampled token's logprob and kept count at each position of a `FlatLogprobs`
    (logprobs=0: vLLM keeps exactly the sampled token per position; the rank slot carries the
    kept count, see `_install_semantics`)."""
    if not flat:
        return [], []
    lps, kept = [], []
    for pos, tok in enumerate(ids):
        j = flat.start_indices[pos]
        if flat.token_ids[j] != tok:
            raise RuntimeError(f"vLLM logprob at position {pos} is for token {flat.token_ids[j]}, "
                               f"not the sampled {tok}")
        lps.append(float(flat.logprobs[j]))
        kept.append(int(flat.ranks[j]))
    return lps, kept


def _install_semantics(worker) -> None:
    """Runs in each vLLM worker: wrap the sampler so that it reports log-probs under the run's
    semantics and the kept count per sampled token (see the module docstring)."""
    import torch

    sampler = worker.model_runner.sampler
    if getattr(sampler, "_posttrain_semantics", None) is not None:
        return
    inner = getattr(sampler, "topk_topp_sampler", None)
    if inner is None or not hasattr(sampler, "gather_logprobs") or \
            sampler.logprobs_mode != "processed_logprobs":
        import vllm

        raise RuntimeError(f"vLLM {vllm.__version__}: the sampler no longer has the "
                           "topk_topp_sampler / gather_logprobs pieces posttrain wraps to report "
                           "log-probs under a stated semantics; pin the vLLM version in "
                           "pyproject.toml or port rollout/vllm_engine.py:_install_semantics")

    class Semantics(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.full, self.kept = inner, False, None

        def forward(self, logits, generators, k, p):
            # the logits arrive temperature-scaled; `inner` may mask them in place
            full = logits.log_softmax(dim=-1, dtype=torch.float32) if self.full else None
            sampled, processed = self.inner(logits, generators, k, p)
            self.kept = None if processed is None else torch.isfinite(processed).sum(-1)
            return sampled, (full if self.full else processed)

    wrapper = Semantics(inner)
    original_gather = sampler.gather_logprobs

    def gather_logprobs(logprobs, num_logprobs, token_ids):
        out = original_gather(logprobs, num_logprobs, token_ids=token_ids)
        kept = wrapper.kept
        wrapper.kept = None
        if kept is None or kept.shape[0] != logprobs.shape[0]:  # greedy: nothing was cut
            kept = torch.full((logprobs.shape[0],), logprobs.shape[-1], dtype=torch.int64,
                              device=logprobs.device)
        return out._replace(selected_token_ranks=kept.to(out.selected_token_ranks.dtype))

    sampler.topk_topp_sampler = wrapper
    sampler.gather_logprobs = gather_logprobs
    sampler._posttrain_semantics = wrapper


def _set_full_logprobs(worker, full: bool) -> None:
    worker.model_runner.sampler._posttrain_semantics.full = full


def _start_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _finish_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.model_config)
    _after_reload(worker)
    runner.reset_lora_state()  # what vLLM's own reload_weights resets after loading


def _after_reload(worker) -> None:
    """What vLLM's layerwise reload leaves undone on CPU (nothing to do on GPUs)."""
    import torch

    model = worker.model_runner.get_model()
    if next(model.parameters()).device == torch.device("cpu"):
        _refresh_embedding_gemms(model)
        _refresh_moe_prepack(model)


def _refresh_embedding_gemms(model) -> None:
    """vLLM's CPU backend prepacks the embedding matrix for its use as a tied LM head
    (`UnquantizedEmbeddingMethod.process_weights_after_loading`), and `reload_weights` does not
    redo it: a tied model would keep computing logits with the old embedding. Redo it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)


def _refresh_moe_prepack(model) -> None:
    """vLLM 0.32's unquantized MoE method runs its experts' `process_weights_after_loading`
    (on CPU: the prepack into the grouped-GEMM layout) only on the first load; after an RL
    weight update the CPU kernel would read freshly loaded, unpacked experts as if packed (the
    probe check measured a log-prob gap of 0.5 on a tiny Qwen3-MoE). Redo it on CPU."""
    import torch

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith("cpu_moe") and \
                getattr(module, "w13_weight", None) is not None and module.w13_weight.device == torch.device("cpu"):
            experts.process_weights_after_loading(module)


def _to_torch(arr):
    import torch

    if isinstance(arr, torch.Tensor):
        return arr
    if isinstance(arr, np.ndarray):
        if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch takes its bits
            return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(arr))
    try:  # a JAX array: zero-copy through DLPack on CPU
        return torch.utils.dlpack.from_dlpack(arr)
    except Exception:
        return torch.from_numpy(np.asarray(arr).copy())
