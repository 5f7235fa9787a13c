#!/bin/bash
# A Megatron-LM launch of GPT-3 1.3B on 2 nodes of 8 A100 80GB as a team might run it today
# (`stratagem estimate gpt3-1.3b --cluster 2x8xa100-80gb --from megatron:examples/trainers/megatron_gpt3_1.3b.sh`).
# stratagem reads the arguments after the script name; the launcher, comments and bash arrays are skipped.
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPT_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
)
torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --micro-batch-size 2 \
    --global-batch-size 64 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --use-distributed-optimizer \
    --bf16 \
    --lr 2e-4 --train-iters 10000 \
    --data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer
