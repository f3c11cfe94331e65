"""The GPU check (`benchmarks/gpu/run.py`): its arguments, and its whole control flow as a CPU dry
run (tiny shapes; the calls that need CUDA or NCCL stood in by `rollout.cuda_standins`), down to
the JSON it writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import run as gpu

ROOT = Path(__file__).resolve().parents[1]


def test_unknown_part_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--out", str(tmp_path), "--parts", "sft,warp"])
    assert e.value.code == 2 and "unknown ['warp']" in capsys.readouterr().err


def test_the_shapes_are_qwen3_0_6b_and_1_7b():
    s = gpu.shapes(dry=False)
    params = {k: sum(gpu._param_count(c).values()) for k, c in s.items()}
    assert abs(params["0.6b"] - 0.596e9) < 0.01e9 and abs(params["1.7b"] - 1.72e9) < 0.02e9, params


def test_the_install_script_installs_the_cuda_extras_then_runs_the_check():
    sh = (ROOT / "benchmarks/gpu/run.sh").read_text()
    assert "'.[cuda,vllm,test]'" in sh and "-m benchmarks.gpu.run --out" in sh
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu/run.sh")], capture_output=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_the_results(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    # every part but grpo (CI time: its JAX trainer + vLLM in processes of their own through the
    # stood-in IPC engine is tests/rollout/test_vllm_transfer.py's and the GRPO e2e's path)
    parts_run = [p for p in gpu.PARTS if p != "grpo"]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--out", str(tmp_path),
                        "--dry-run", "--parts", ",".join(parts_run)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200, start_new_session=True)
    res = json.loads((tmp_path / "results.json").read_text())
    assert r.returncode == 0, json.dumps({k: v.get("error") for k, v in res["parts"].items()})[-4000:]
    parts = res["parts"]
    assert res["dry_run"] and list(parts) == parts_run
    assert all(p["status"] == "ok" for p in parts.values())
    for name in ("0.6b", "1.7b"):
        m = parts["sft"]["models"][name]
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1 and m["loss"] > 0
    dec = parts["decode"]
    assert set(dec["engines"]) == {"jax", "vllm"} and dec["jax_over_vllm"] > 0
    assert all(e["tokens_per_s"] > 0 and e["of_roofline"] > 0 for e in dec["engines"].values())
    par = parts["parity"]["models"]
    assert par["float32"]["max_abs"] <= 1e-4  # the fp32 bound of tests/models (same kernels class)
    assert par["bfloat16"]["argmax_agree"] >= 0.9
    for p in parts_run:
        assert json.loads((tmp_path / f"{p}.json").read_text())


def test_tpu_train_step_dry_run_writes_its_table(tmp_path):
    """`benchmarks/tpu/train_step.py` (run on the TPU machine) stays runnable: its CPU dry run
    trains a tiny model through the same code, with the LM head in chunks, a LoRA over an int8
    base with its op profile, and a LoRA DPO step, and writes JSON."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.train_step", "--dry-run",
                        "--head-chunk", "32", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "train_step.json").read_text())
    full, lora, dpo = res["runs"]
    assert full["head_chunk_positions"] == 16 and full["tokens_per_s"] > 0 and full["loss"] > 0
    # XLA's own bytes for the program (arguments + temporaries): the figure a chip's peak
    # counter does not give (it misses the program's temporaries on a TPU)
    assert full["xla_bytes"] > full["xla_temp_bytes"] > 0
    # LoRA over an int8 frozen base, bf16 parameters: only the adapters train, and the profile
    # says where the step's op time goes
    assert lora["lora_rank"] == 4 and lora["int8_base"] and lora["loss"] > 0
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 4
    prof = lora["profile"]
    assert prof["op_ms_per_step"] > 0 and prof["top_ops"] and prof["by_category_ms"]
    # a DPO step of LoRA pairs, the reference scored with the adapters off: the policy starts
    # as the reference (loss log 2) and its few steps lower the loss from there
    assert dpo["algorithm"] == "dpo" and dpo["tokens_per_s"] > 0
    assert 0.5 < dpo["loss"] < 0.6931472


def test_tpu_decode_dry_run_writes_its_table(tmp_path):
    """`benchmarks/tpu/decode.py` (run on the TPU machine) stays runnable: its CPU dry run
    decodes a tiny model through the engine's own program (`generate_program`; scanned and unrolled layers,
    nucleus sampling, the op profile) and writes per-step times and the roofline's bytes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.decode", "--dry-run",
                        "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    plain, nucleus = json.loads((tmp_path / "decode.json").read_text())["runs"]
    assert plain["scan_layers"] and not nucleus["scan_layers"] and nucleus["top_p"] == 0.9
    assert plain["kv_layout"] == "skbd"  # the stacked slot-outermost cache, pinned in place
    for run in (plain, nucleus):
        assert run["step_ms"] > 0 and run["generate_s"] > run["prefill_s"]
        assert run["weights_bytes"] > 0 and run["kv_bytes_per_step"] > 0
    assert nucleus["profile_per_generate"]["op_ms_per_step"] > 0
    assert nucleus["kv_int8"] and not plain["kv_int8"]  # int8: 1 + 4/32 bytes per value, not 2
    assert nucleus["attention"] == "decode" and plain["attention"] == "xla"  # the Pallas kernel
    per_value = {r["config"]: r["kv_bytes_per_step"] / (r["batch"] * (r["prompt"] + r["new"] / 2))
                 for r in (plain, nucleus)}
    assert per_value[nucleus["config"]] / per_value[plain["config"]] == (1 + 4 / 32) / 2


def test_tpu_decode_attention_dry_run_compares_the_kernel_with_xla(tmp_path):
    """`benchmarks/tpu/decode_attention.py` stays runnable: its CPU dry run times the interpreted
    Pallas decode kernel beside XLA's attention (bf16 and int8 caches, one and two slot blocks,
    transposed and slot-major keys), and XLA's attention over the slot-outermost cache beside
    XLA's over slot-major keys; each pair agrees to bf16 rounding."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.decode_attention", "--dry-run",
                        "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads((tmp_path / "decode_attention.json").read_text())["runs"]
    assert [r["int8"] for r in runs] == [False, True, True, False, True]
    assert runs[0]["block"] == [4, 128]
    assert [r["layout"] for r in runs] == ["ds", "ds", "sd", "skbd", "skbd"]
    for run in runs:
        other = "xla_sd_us" if run["layout"] == "skbd" else "kernel_us"
        assert run["xla_us"] > 0 and run[other] > 0
        assert run["max_abs_diff"] < 2e-2  # bf16 outputs of order 1: a few ulps


def test_tpu_grpo_step_dry_run_runs_the_one_chip_recipe(tmp_path):
    """`benchmarks/tpu/grpo_step.py` (run on the TPU machine) stays runnable: its CPU dry run
    runs the shipped one-chip recipe (LoRA, the int8 KV cache, decode calls of at most
    `max_rows`) through `posttrain run` on a tiny random model and reports the step's phases;
    nothing compiles after the first step."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.grpo_step", "--dry-run",
                        "--steps", "3", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "grpo_step.json").read_text())
    assert res["workload"]["lora_rank"] == 16 and res["workload"]["rollout"]["kv_cache_dtype"] == "int8"
    assert res["step_s"] > 0 and res["rollout_s"] > 0 and res["update_s"] > 0
    # a random policy runs to the limit but for a rare end token (the steady steps 2 and 3
    # are timed now: step 2 has one such completion of its 64)
    assert 15 < res["completion_tokens_mean"] <= 16 and res["steps_timed"] == 2
    assert res["compiles_per_step"][2:] == [0, 0]
    # pi_old is the engine's (the recipe's `grpo.logp_old: rollout`): no scoring pass, and the
    # trainer/engine agreement still measured, off the first mini-batch's forward
    assert 0 <= res["mismatch_kl"] < 1e-2, res


def test_tpu_sft_run_dry_run_compares_the_accelerator_with_the_cpu(tmp_path):
    """`benchmarks/tpu/sft_run.py` (run on the TPU machine) stays runnable: its CPU dry run writes
    a random model and tokenizer, runs the shipped one-chip SFT recipe through `posttrain run`
    and the two comparison runs, and reads every step's loss back (here all three on the CPU, so
    the comparison's losses are equal)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.sft_run", "--dry-run", "--steps", "2",
                        "--compare-steps", "2", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "sft_run.json").read_text())
    assert len(res["shipped"]["losses"]) == 2 and res["shipped"]["compiles_per_step"][1:] == [0]
    cmp = res["compare"]
    assert len(cmp["accelerator"]["losses"]) == len(cmp["cpu"]["losses"]) == 2
    assert cmp["agree"] and cmp["max_rel_diff"] <= res["loss_rtol"]


def test_tpu_hlo_cost_reads_the_compilers_estimates_per_loop(tmp_path):
    """`benchmarks/tpu/hlo_cost.py` compiles a recipe's train step for a v5e on this CPU (libtpu)
    and reads the TPU compiler's per-op cycle estimates: a scanned 4-layer model's forward and
    backward layer loops are found with their 4 trips, the step's estimate is their ops' sum
    and more, and the costliest ops name the JAX operations they come from; the saved program
    reads back to the same figures (`--hlo`, how the chip's own program is read). Under remat
    `save_attention` the program holds one splash forward kernel (the layer scan's forward), not
    a second in the backward's recompute."""
    saved = tmp_path / "step.hlo.txt"
    cmd = [sys.executable, "-m", "benchmarks.tpu.hlo_cost", "recipes/sft_tiny.yaml",
           "model.scan_layers=true", "model.remat=save_attention", "--top", "5", "--save", str(saved)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from benchmarks.tpu.hlo_cost import read_program

    prog = read_program(saved.read_text())
    layer_loops = [ms for _, trips, ms in prog.loops if trips == 4]
    assert len(layer_loops) >= 2 and all(ms > 0 for ms in layer_loops), prog.loops
    assert prog.ms > sum(layer_loops)
    assert any("dot_general" in o.source for o in sorted(prog.ops, key=lambda o: -o.ms)[:5])
    assert f"step, estimated: {prog.ms:.1f} ms" in r.stdout
    # remat save_attention: the backward's layer loop does not rerun splash's forward kernel
    kernels = [o.name for o in prog.ops if o.name.startswith("splash_mqa_fwd")]
    assert len(kernels) == 1, kernels


def test_hlo_cost_counts_a_decode_loops_kv_copies_into_vmem():
    """`hlo_cost.loop_vmem_copies` (what `benchmarks.tpu.decode_compile` reports as
    `kv_vmem_copies_per_step`) counts, per while-loop body, the async copies of a matching buffer
    into VMEM (S(1)): a whole copy and each slice of a sliced one, not a copy back out of VMEM,
    not a weight's slices, not a body with none. The lines are a v5e decode program's own."""
    from benchmarks.tpu.hlo_cost import loop_vmem_copies

    kv = "{3,2,1,0:T(8,128)(2,1)}"
    kv_vmem = "{3,2,1,0:T(8,128)(2,1)S(1)}"
    text = "\n".join([
        "%decode_body (p: (s32[])) -> (s32[]) {",
        f"  %slice-start.476 = ((bf16[128,8,224,128]{kv}), bf16[32,8,224,128]{kv_vmem}, "
        "s32[]{:S(2)}) slice-start(%get-tuple-element.60001), slice={[0:32], [0:8], [0:224], [0:128]}",
        f"  %slice-start.477 = ((bf16[128,8,224,128]{kv}), bf16[32,8,224,128]{kv_vmem}, "
        "s32[]{:S(2)}) slice-start(%get-tuple-element.60001), slice={[32:64], [0:8], [0:224], [0:128]}",
        f"  %copy-start.24 = (bf16[128,8,224,128]{kv}, bf16[128,8,224,128]{kv_vmem}, u32[]{{:S(2)}}) "
        "copy-start(%dynamic_update_slice.2043)",
        f"  %copy-start.64 = (bf16[128,8,224,128]{kv_vmem}, bf16[128,8,224,128]{kv}, u32[]{{:S(2)}}) "
        "copy-start(%get-tuple-element.57538)",
        "  %slice-start.548 = ((bf16[1024,3072]{1,0:T(8,128)(2,1)}), bf16[256,3072]{1,0:T(8,128)(2,1)S(1)}, "
        "s32[]{:S(2)}) slice-start(%get-tuple-element.58060), slice={[0:256], [0:3072]}",
        "}",
        "%sampler_body (p: (s32[])) -> (s32[]) {",
        "  %slice-start.9 = ((bf16[1024,3072]{1,0:T(8,128)(2,1)}), bf16[256,3072]{1,0:T(8,128)(2,1)S(1)}, "
        "s32[]{:S(2)}) slice-start(%get-tuple-element.5), slice={[0:256], [0:3072]}",
        "}",
        "ENTRY %main.1 (a: s32[]) -> s32[] {",
        "  %while.1 = (s32[]) while(%tuple.1), condition=%cond, body=%decode_body",
        "  %while.2 = (s32[]) while(%tuple.2), condition=%cond, body=%sampler_body",
        "}",
    ])
    assert loop_vmem_copies(text, r"bf16\[128,8,\d+,128\]") == {"decode_body": 3}
    assert loop_vmem_copies(text, r"bf16\[1024,3072\]") == {"decode_body": 1, "sampler_body": 1}
    assert loop_vmem_copies(text, r"bf16\[64,8,\d+,128\]") == {}


def test_tpu_kv_write_dry_run_times_each_cache_type(tmp_path):
    """`benchmarks/tpu/kv_write.py` (the decode's per-step KV row writes alone, by cache element
    type and layout) stays runnable: its CPU dry run times every variant and counts the written
    bytes (a u32 pair of bf16 K and V holds bf16's bytes in half the buffers)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.kv_write", "--dry-run",
                        "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = {x["variant"]: x for x in json.loads((tmp_path / "kv_write.json").read_text())["runs"]}
    assert set(runs) == {"bf16", "f32", "pair32", "skbd"}
    assert all(x["step_us"] > 0 for x in runs.values())
    assert runs["pair32"]["row_bytes"] == runs["bf16"]["row_bytes"] == runs["f32"]["row_bytes"] // 2
    # the slot-outermost cache writes whole tiles: 16x fewer bytes moved than bf16's rewrite
    assert runs["skbd"]["row_bytes"] == runs["bf16"]["row_bytes"]
    assert runs["skbd"]["tile_rmw_bytes"] * 16 == runs["bf16"]["tile_rmw_bytes"]
    assert runs["pair32"]["buffers"] * 2 == runs["bf16"]["buffers"]
