set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-packages .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site-packages
timeout 140 torchrun --standalone --nproc_per_node 2 benchmarks/grpo_generation.py --modes static --profile --json $OUT/gen.json > $OUT/gen.log 2>&1; grep -v Warning $OUT/gen.log | grep -E "^\||rank|Error|error" | tail -12
timeout 150 python3 benchmarks/vs_trl.py --trainer grpo --rows odc --num-processes 2 --model qwen2.5-1.5b --samples-per-device 16 --max-completion-length 512 --steps 2 --warmup 1 --logs $OUT/grpo_logs --json $OUT/vs_trl_grpo_odc.json 2>&1 | grep -v Warning | tail -5; grep -E "step_time|generation|Error" $OUT/grpo_logs/odc.log | tail -4
