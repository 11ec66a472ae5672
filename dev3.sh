#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-packages .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site-packages
A=(--distribution longalign --samples-per-device 8 --steps 20 --warmup 3)
timeout 330 python3 benchmarks/vs_trl.py --num-processes 2 --model qwen2.5-1.5b "${A[@]}" --rows odc --json $OUT/vs_trl_odc.json > $OUT/vs_trl.log 2>&1
tail -8 $OUT/vs_trl.log
timeout 240 torchrun --standalone --nproc_per_node 2 benchmarks/sft_throughput.py --warm-attention-plans --trainer-data \
  --schemes "ODC+LB-Mini calibrated" "${A[@]}" --json $OUT/sft_same.json > $OUT/sft.log 2>&1
grep -v Warning $OUT/sft.log | tail -14
gzip $OUT/*.log
