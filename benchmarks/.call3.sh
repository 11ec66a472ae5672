set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-packages .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site-packages
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels_attention.py tests/unit/test_trainer_checkpoint_attention.py 2>&1 | tail -3
timeout 170 torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py --steps 1 --warmup 3 --json $OUT/profile_step.json > $OUT/profile_step.log 2>&1; grep -A8 "^qwen" $OUT/profile_step.log; grep -B1 -A2 "host waits" $OUT/profile_step.log | grep -v "^--" | grep "host waits\|gap" | head -18; grep "microbatches (span" $OUT/profile_step.log
timeout 170 python3 benchmarks/vs_trl.py --trainer grpo --num-processes 2 --model qwen2.5-1.5b --samples-per-device 16 --max-completion-length 512 --steps 2 --warmup 1 --logs $OUT/grpo_logs --json $OUT/vs_trl_grpo.json 2>&1 | grep -v Warning | tail -6
timeout 150 python3 benchmarks/vs_trl.py --trainer dpo --num-processes 2 --model qwen2.5-1.5b --distribution longalign --length-scale 0.25 --samples-per-device 4 --trl-accumulation 4 --steps 3 --warmup 3 --logs $OUT/dpo_logs --json $OUT/vs_trl_dpo.json 2>&1 | grep -v Warning | tail -6
