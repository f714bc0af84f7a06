"""GPU proof kit: one command that proves the bf16 indexer kernels on a CUDA host in minutes.

    PYTHONPATH=sgl-kernel/python python -m benchmark.gpu_check --out out/gpu-check
    scripts/gpu_check.sh --out out/gpu-check          # the same, path set up for you
    python -m benchmark.gpu_check --plan               # stages and their time budgets, runs nothing
    python -m benchmark.gpu_check --smoke --out build/gpu-smoke   # CPU dry run, seconds

Needs only torch and triton (a bare CUDA image: PyTorch 2.11, Triton 3.6, Python 3.12); it imports
nothing of the project that needs sglang and installs nothing. Stages, each under a time budget
the kit enforces (a stage past its budget is stopped and reported as such):

- environment: GPU name, capability, SMs, versions, measured device copy bandwidth;
- correctness: DeepSeek-V4 indexer shapes (64 heads, head_dim 128, 64-key pages, shuffled page
  tables with -1 entries, lengths not a multiple of a page): the Triton kernel, the torch path and
  an independent fp32 reference, decode B = 1, 8, 32, 64 at 8k / 32k / 80k keys, a decode batch
  padded with seq_len 0 rows (CUDA-graph padding) and the prefill row-chunked call; max relative
  error, top-512 agreement and the -inf tail past seq_len per case; the fused query rotation and
  key store (decode and prefill plans) against their torch references;
- cuda_graphs: the logits call (Triton and torch) and the query / key rotations captured at the
  decode batch sizes, replayed with new seq_lens, page tables and queries, bit-equal to eager;
- speed: ratios from one run: Triton vs torch path, achieved bytes/s over the measured copy
  bandwidth (roofline fraction), the bf16 step vs an fp8 paged-logits step at the same shape;
- launch_sweep: every candidate launch config checked and timed; the best per GPU is written to
  DIR/tuned_launch.json (`--record` merges it into sgl_kernel_dsv4/tuned_launch.json, atomically,
  and only from a run that proved correctness);
- sglang (when sglang is importable): the real DeepSeekV4TokenToKVPool on CUDA, bf16 keys written
  and read through the patched indexer for one decode step, against the same step on the CPU,
  once per top-k step sm_120 serving runs (upstream's torch top-k, its CUDA top-k v1 and v2).

Writes DIR/gpu_check.json (every figure, strict JSON) and DIR/gpu_check.md (the table a person
reads). A GPU run refuses TRITON_INTERPRET=1.

The package: `harness` (stages, budgets, the run, environment, --record), `correctness`
(correctness, cuda_graphs), `tuner` (speed, launch_sweep), `sglang_stage` (sglang), `report`
(targets, JSON, Markdown). A stage is a `harness.Stage` in a module's STAGES; a new module goes
into `harness.STAGE_MODULES`.
Exit status: 0 every correctness check passed; 1 a correctness check failed or could not finish
(the performance targets are reported as pass / fail lines and never change the exit status);
2 the kit could not run (bad arguments, no CUDA without --smoke).
"""
