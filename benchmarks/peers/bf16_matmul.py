"""Why TRL ran ~17x slower than itself on some of these machines: its defaults (TRL >= 1.x sets
`bf16=True` and `gradient_checkpointing=True` in SFTConfig and GRPOConfig) put every matmul under
bf16 autocast, and on a CPU without AVX512_BF16 / AMX torch computes bf16 matmuls at a fraction
of the fp32 rate. The peer scripts therefore pass `bf16=False, gradient_checkpointing=False`
(fp32 without remat, as every contender runs). This prints both rates and the CPU flags.

    python -m benchmarks.peers.bf16_matmul
"""

from __future__ import annotations

import time

import torch


def gflops(a: torch.Tensor, b: torch.Tensor, autocast: bool = False, reps: int = 5) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        dt = (time.perf_counter() - t) / reps
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / dt / 1e9


def main():
    flags = set(open("/proc/cpuinfo").read().split())
    print("CPU flags:", {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    print(f"fp32 matmul            {gflops(a, b):8.1f} GFLOP/s")
    print(f"bf16 matmul            {gflops(a.bfloat16(), b.bfloat16()):8.1f} GFLOP/s")
    print(f"fp32 under bf16 autocast (TRL's default) {gflops(a, b, autocast=True):8.1f} GFLOP/s")
    from trl import GRPOConfig, SFTConfig

    for cls in (SFTConfig, GRPOConfig):
        c = cls(output_dir="/tmp/trl_defaults", use_cpu=True, report_to=[])
        print(f"{cls.__name__} defaults: bf16={c.bf16} gradient_checkpointing={c.gradient_checkpointing}")


if __name__ == "__main__":
    main()
