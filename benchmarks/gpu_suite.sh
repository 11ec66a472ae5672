#!/usr/bin/env bash
# Everything that needs GPUs, in one lease: environment facts, the CUDA tests, the comm, end-to-end, packed-attention,
# SFT-throughput, step profile, stock-TRL comparison, GRPO policy-update and generation, the other trainers' points, calibration, hybrid and meeting-cost benchmarks. Logs and JSON go to $OUT. Usage (2 GPUs of one host):
# STEPS=env,tests,grpo bash benchmarks/gpu_suite.sh
# The device image has no trl / datasets: carry them as wheels in .whl (see the device README).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}
mkdir -p "$OUT"
STEPS=${STEPS:-env,tests,comm,e2e}
if [ -d .whl ]; then
  # A folder whose path holds "site-packages": dill (under datasets' fingerprints) pickles a module found elsewhere by
  # value, and pyarrow's module then fails to pickle ("Can't pickle <class 'MonthDayNano'>").
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-packages .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site-packages"
fi
nproc=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [[ $STEPS == *env* ]]; then
  nvidia-smi topo -m 2>&1 | head -5
  python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
fi
if [[ $STEPS == *tests* ]]; then
  # The CUDA tests (the fused kernels' too), and the packed-attention and timing tests on this image's transformers
  # (CI has a newer one).
  timeout 420 python3 -m pytest -x -q -p no:cacheprovider --durations=12 tests/distributed/test_engine.py \
    tests/distributed/test_engine_timing.py tests/unit/test_kernels_attention.py tests/unit/test_trainer_attention.py \
    tests/unit/test_kernels_fused.py tests/unit/test_kernels_decode_attention.py tests/unit/test_generation_static.py \
    -k "cuda or attention or timing or bubble${TESTS_K:+ and ($TESTS_K)}" \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -18
fi
if [[ $STEPS == *comm* ]]; then
  for cfg in ${COMM_CONFIGS:-p0 p32}; do  # p<N>: the accumulate kernel with at most N programs (0: uncapped)
    HF_ODC_SCATTER_PROGRAMS=${cfg:1} timeout 120 torchrun --standalone --nproc_per_node "$nproc" \
      benchmarks/comm.py --label "$cfg" --json "$OUT/comm_$cfg.json" 2>&1 | tee "$OUT/comm_$cfg.log" | grep -v Warning | tail -7
  done
fi
if [[ $STEPS == *e2e* ]]; then
  timeout 300 torchrun --standalone --nproc_per_node "$nproc" benchmarks/e2e_step.py ${E2E_ARGS:-} --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | grep -v Warning | tail -8
fi
if [[ $STEPS == *attn* ]]; then
  # Packed attention: one layer against unpacked documents, a 1.5B model's packed rows per backend, reference passes.
  timeout 150 python3 benchmarks/packed_attention.py --mode layer --dense --json "$OUT/packed_attention.json" 2>&1 | tee "$OUT/packed_attention.log" | tail -7
  timeout 300 python3 benchmarks/packed_attention.py --mode model --json "$OUT/packed_attention_model.json" 2>&1 | tee "$OUT/packed_attention_model.log" | tail -12
  timeout 120 python3 benchmarks/packed_attention.py --mode forward --json "$OUT/packed_attention_forward.json" 2>&1 | tee "$OUT/packed_attention_forward.log" | tail -12
fi
if [[ $STEPS == *headline* ]]; then
  # HEADLINE_ARGS e.g. "--distribution swe-smith --samples-per-device 4"; the name tags the output files. cuDNN's
  # per-length plans are built before any scheme is timed: a short run would otherwise charge each new length's plan
  # to whichever scheme first puts that document on a rank (a training run pays each once).
  name=${HEADLINE_NAME:-headline}
  timeout "${HEADLINE_TIMEOUT:-540}" torchrun --standalone --nproc_per_node "$nproc" benchmarks/sft_throughput.py --warm-attention-plans ${HEADLINE_ARGS:-} \
    --json "$OUT/sft_$name.json" --plot "$OUT/sft_$name.png" 2>&1 | tee "$OUT/sft_$name.log" | grep -v Warning | tail -16
fi
if [[ $STEPS == *profile* ]]; then
  # Where an SFT step's device time goes per scheme, kind of kernel and microbatch; PROFILE_ARGS extra.
  timeout "${PROFILE_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$nproc" benchmarks/profile_step.py ${PROFILE_ARGS:-} \
    --json "$OUT/profile_step.json" 2>&1 | tee "$OUT/profile_step.log" | grep -v Warning | tail -40
fi
if [[ $STEPS == *vs_trl* ]]; then
  # Stock TRL SFTTrainer (defaults; padding-free with odc_packed) against ODCSFTTrainer, one accelerate launch per row;
  # VS_TRL_ARGS extra (e.g. "--trl-accumulation 1" for TRL's padded batches of all 8 samples, "--rows odc").
  # VS_TRL_ARGS="--trainer dpo": DPOTrainer against ODCDPOTrainer on long-tailed pairs; "--trainer grpo": GRPOTrainer
  # (transformers generate) against ODCGRPOTrainer, generation in the step, completions up to 256 tokens.
  timeout "${VS_TRL_TIMEOUT:-540}" python3 benchmarks/vs_trl.py --num-processes "$nproc" --model qwen2.5-1.5b \
    --distribution longalign --samples-per-device 8 --steps 6 --warmup 3 --trl-accumulation 4 ${VS_TRL_ARGS:-} \
    --json "$OUT/vs_trl.json" 2>&1 | tee "$OUT/vs_trl.log" | grep -v Warning | tail -8
fi
if [[ $STEPS == *layer_share* ]]; then
  # ODCSFTTrainer (wall clock, vs_trl.py) with each of LAYER_SHARES of its decoder layers checkpointed
  # (checkpoint_layer_share; 1.0: every layer, the default), longalign at 8 per GPU, 20 timed steps after 3: #45
  # item 1's MFU and memory.
  for share in ${LAYER_SHARES:-1.0 0.5}; do
    timeout 270 python3 benchmarks/vs_trl.py --num-processes "$nproc" --model qwen2.5-1.5b --distribution longalign \
      --samples-per-device 8 --steps 20 --warmup 3 --rows odc --checkpoint-layer-share "$share" \
      --json "$OUT/vs_trl_share_$share.json" 2>&1 | tee "$OUT/vs_trl_share_$share.log" | grep -v Warning | tail -1
  done
fi
if [[ $STEPS == *same_data* ]]; then
  # ODCSFTTrainer (wall clock, vs_trl.py) and the harness (device-timed, the trainers' default scheme) on the very same
  # minibatches (--trainer-data), longalign at 8 per GPU, 20 timed steps after 3: #45's trainer-against-harness ratio.
  # LAYER_SHARE: both checkpoint that share of the layers (checkpoint_layer_share; default 1.0, every layer).
  A=(--distribution longalign --samples-per-device 8 --steps 20 --warmup 3 --checkpoint-layer-share "${LAYER_SHARE:-1.0}")
  timeout 270 python3 benchmarks/vs_trl.py --num-processes "$nproc" --model qwen2.5-1.5b "${A[@]}" --rows odc \
    --json "$OUT/vs_trl_same_data.json" 2>&1 | tee "$OUT/vs_trl_same_data.log" | grep -v Warning | tail -3
  timeout 240 torchrun --standalone --nproc_per_node "$nproc" benchmarks/sft_throughput.py --warm-attention-plans \
    --trainer-data --schemes "ODC+LB-Mini calibrated" "${A[@]}" --json "$OUT/sft_same_data.json" 2>&1 \
    | tee "$OUT/sft_same_data.log" | grep -v Warning | tail -5
fi
if [[ $STEPS == *memory* ]]; then
  # Peak memory per scheme on swe-smith at 4 per GPU: each scheme's peak step, its largest microbatch, the difference
  # to FSDP2 over the rank-steps with the same microbatches, and the memory after each phase of the peak step.
  timeout 300 torchrun --standalone --nproc_per_node "$nproc" benchmarks/sft_throughput.py --distribution swe-smith \
    --samples-per-device 4 --warmup 0 --steps 4 --schemes Collective+LB-Micro,ODC+LB-Micro,ODC+LB-Mini \
    --predict-world-sizes 8 --memory-phases --json "$OUT/sft_memory.json" 2>&1 | tee "$OUT/sft_memory.log" \
    | grep -v Warning | tail -30
fi
if [[ $STEPS == *sft* ]]; then
  # ODCSFTTrainer, 20 steps of a Qwen2-0.5B-shaped model (random weights) on long-tailed synthetic chats, bf16.
  timeout 300 accelerate launch --config_file examples/odc.yaml --num_processes "$nproc" examples/sft.py \
    --model_config qwen2-0.5b --dataset synthetic-longtail --num_samples 1024 --max_length 16384 \
    --per_device_train_batch_size 16 --max_steps 20 --logging_steps 1 --save_strategy no --report_to none \
    --disable_tqdm true --output_dir /tmp/sft ${SFT_ARGS:-} 2>&1 | tee "$OUT/sft.log" | grep -E "tokens_per_second|Error|error" | tail -4
fi
if [[ $STEPS == *grpo* ]]; then
  # ODCGRPOTrainer's schemes on the same injected long-tailed rollouts (Qwen2.5-1.5B shape), plus a generation run.
  TRL_EXPERIMENTAL_SILENCE=1 timeout 540 python3 benchmarks/grpo_policy_update.py --num-processes "$nproc" --steps 5 \
    --timeout 140 --generate-steps 2 --generate-length 256 --logs "$OUT/grpo_logs" \
    --json "$OUT/grpo_policy_update.json" ${GRPO_ARGS:-} 2>&1 | tail -14
fi
if [[ $STEPS == *trainers* ]]; then
  # ODCRewardTrainer, ODCKTOTrainer, ODCRLOOTrainer and ODCDistillationTrainer (Qwen2.5-1.5B shape, long-tailed data)
  # under FSDP2 on TRL's split, FSDP2 + LB-Micro and ODC + LB-Mini: one launch per trainer, its schemes in turn;
  # TRAINERS_BUDGET seconds in all (trainers and schemes that would not end in time are skipped), TRAINERS_ARGS extra.
  TRL_EXPERIMENTAL_SILENCE=1 timeout "${TRAINERS_TIMEOUT:-570}" python3 benchmarks/trainer_points.py --num-processes "$nproc" \
    --budget "${TRAINERS_BUDGET:-450}" --logs "$OUT/trainer_logs" --json "$OUT/trainer_points.json" ${TRAINERS_ARGS:-} 2>&1 \
    | tee "$OUT/trainer_points.log" | grep -v Warning | tail -20
fi
# KTO and RLOO at 8 items per GPU under ODC + LB-Mini, a trainer setting on (its default) and off, one launch each,
# ONOFF_BUDGET seconds per setting: $1 names the outputs, $2 is the setting.
on_and_off() {
  for mode in true false; do
    TRL_EXPERIMENTAL_SILENCE=1 timeout $(( ${ONOFF_BUDGET:-200} + 60 )) python3 benchmarks/trainer_points.py \
      --num-processes "$nproc" --trainers kto,rloo --global-batch-size $(( 8 * nproc )) --steps 14 --warmup 2 \
      --schemes "ODC + LB-Mini" --budget "${ONOFF_BUDGET:-200}" --grace 20 --min-launch-s 60 \
      --extra "--gradient_checkpointing true --$2 $mode" --logs "$OUT/$1_logs_$mode" \
      --json "$OUT/trainer_points_$1_$mode.json" 2>&1 | grep -v Warning | tail -4
  done
}
if [[ $STEPS == *gc* ]]; then
  # Python's collector between steps (manual_gc) or left to run by itself: whether collections inside a rank's
  # minibatch make the short-row trainers' bubble.
  on_and_off gc manual_gc
fi
if [[ $STEPS == *warm* ]]; then
  # The attention plans warmed (the training passes' and the forward-only passes', before the pass that meets a
  # length) or built where a pass first meets a length: what planning inside a step costs the short-row trainers.
  on_and_off warm warm_attention_plans
fi
if [[ $STEPS == *gen_share* ]]; then
  # #47 item 3: the GRPO trainer's generation share at 1K-token free completions, 64 per GPU, stock TRL (transformers'
  # generate, about 100 s a step on 2xH200) and ODCGRPOTrainer (the "static" loop) in the same call: 2 timed steps
  # after 1, so that stock TRL's row ends inside the call. Where vLLM is installed, both also run with a colocated
  # engine (the rows trl-vllm and odc-vllm); where it is not, as on the lent GPU image, vs_trl.py says so and skips them.
  TRL_EXPERIMENTAL_SILENCE=1 timeout 580 python3 benchmarks/vs_trl.py --trainer grpo --num-processes "$nproc" \
    --model qwen2.5-1.5b --samples-per-device 64 --num-generations 8 --max-completion-length 1024 --completions free \
    --decoding-loop --steps 2 --warmup 1 --json "$OUT/vs_trl_grpo_share.json" 2>&1 \
    | tee "$OUT/vs_trl_grpo_share.log" | grep -v Warning | tail -6
fi
if [[ $STEPS == *generation* ]]; then
  # GRPO rollout generation in each mode (Qwen2.5-1.5B shape, 64 completions per rank of up to 1K long-tailed new
  # tokens), then one policy update on them; GEN_ARGS extra (e.g. "--modes static --static-attention sdpa").
  name=${GEN_NAME:-grpo_generation}
  timeout "${GEN_TIMEOUT:-540}" torchrun --standalone --nproc_per_node "$nproc" benchmarks/grpo_generation.py ${GEN_ARGS:-} \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v Warning | tail -14
fi
if [[ $STEPS == *hybrid* ]]; then
  # Hybrid ODC (each GPU a one-GPU "host", replicated) against ODC on one host and Collective HSDP; HYBRID_ARGS extra.
  timeout "${HYBRID_TIMEOUT:-420}" torchrun --standalone --nproc_per_node "$nproc" benchmarks/hybrid_step.py ${HYBRID_ARGS:-} \
    --json "$OUT/hybrid_step.json" 2>&1 | tee "$OUT/hybrid_step.log" | grep -v Warning | tail -8
fi
if [[ $STEPS == *meeting* ]]; then
  # The cost of the meeting before each collective of a trainer's step (bounded collectives).
  timeout 120 torchrun --standalone --nproc_per_node "$nproc" benchmarks/meeting_cost.py --json "$OUT/meeting_cost.json" 2>&1 \
    | tee "$OUT/meeting_cost.log" | grep -v Warning | tail -2
fi
if [[ $STEPS == *calibration* ]]; then
  # LB-Mini with the calibrated cost model against the attention cost; CAL_ARGS="--straggler" slows one GPU.
  name=${CAL_NAME:-calibrated}
  timeout "${CAL_TIMEOUT:-540}" torchrun --standalone --nproc_per_node "$nproc" benchmarks/calibrated_balance.py ${CAL_ARGS:-} \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v Warning | tail -12
fi
