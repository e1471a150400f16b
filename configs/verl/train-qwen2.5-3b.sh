#!/usr/bin/env bash
# The paper's MemSearcher GRPO run (Qwen2.5-3B-Instruct) on veRL: one node x 8 GPUs, or two
# nodes through Ray. Every training setting is in configs/verl/grpo-qwen2.5-3b.yaml, with its
# source; this script only starts things in order and passes the site's paths.
#
#   one node:   bash configs/verl/train-qwen2.5-3b.sh
#   two nodes:  on the head:      NNODES=2 bash configs/verl/train-qwen2.5-3b.sh
#               then on node 2:   ray start --address=HEAD_IP:6379   (the script waits)
#
# Needs: pip install 'memsearcher[verl,dense,server]' plus vLLM for your CUDA (veRL's
# `verl[vllm]` extra pins torch 2.11 and vllm 0.24.0; install it in the training environment,
# not in memsearcher's CPU one). Untested on GPUs here: docs/training.md says what was verified.
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
# FlashRAG JSONL: NQ + HotpotQA train for training, any benchmark for validation
TRAIN_JSONL=${TRAIN_JSONL:-data/nq_hotpotqa_train.jsonl}
VAL_DATA=${VAL_DATA:-data/flashrag}
VAL_DATASETS=${VAL_DATASETS:-nq,hotpotqa}
# the E5 index of wiki-18 (memsearcher index build --kind dense ..., docs/retrieval.md)
INDEX=${INDEX:-indexes/wiki18-e5}
RETRIEVER_PORT=${RETRIEVER_PORT:-8000}
HEAD_IP=${HEAD_IP:-$(hostname -I | awk '{print $1}')}
# every agent-loop worker, on every node, reads this (configs/verl/agent_loop.yaml); it reaches
# them through Ray's job runtime env (step 4), so node 2 needs nothing set
RETRIEVER_URL=${RETRIEVER_URL:-http://$HEAD_IP:$RETRIEVER_PORT}

# 1. data: veRL's parquet, one row per question with its golden answers and agent name
mkdir -p data/verl
[ -f data/verl/train.parquet ] || memsearcher verl prepare --data "$TRAIN_JSONL" \
  --agent memsearcher --split train --out data/verl/train.parquet
[ -f data/verl/test.parquet ] || memsearcher verl prepare --data "$VAL_DATA" \
  --datasets "$VAL_DATASETS" --limit 500 --agent memsearcher --split test \
  --out data/verl/test.parquet

# 2. the retriever first, on this (head) node, shared over HTTP by every rollout worker;
#    --host 0.0.0.0 so that the second node reaches it (keep the port inside your cluster)
memsearcher retriever serve --index "$INDEX" --host 0.0.0.0 --port "$RETRIEVER_PORT" \
  --workers 4 > retriever.log 2>&1 &
RETRIEVER_PID=$!
trap 'kill "$RETRIEVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$RETRIEVER_PORT/health" > /dev/null && break
  kill -0 "$RETRIEVER_PID" 2>/dev/null || { cat retriever.log; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$RETRIEVER_PORT/health" > /dev/null || { echo "retriever did not start"; exit 1; }

# 3. Ray: a head on this node; with NNODES=2 wait for the second node to join it
if [ "$NNODES" -gt 1 ]; then
  ray status > /dev/null 2>&1 || ray start --head --port=6379
  echo "waiting for $NNODES nodes (on the other node: ray start --address=$HEAD_IP:6379)"
  until [ "$(python -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(sum(n["Alive"] for n in ray.nodes()))')" -ge "$NNODES" ]; do
    sleep 5
  done
  RAY_ADDRESS_ARG=(+ray_kwargs.ray_init.address=auto)
else
  RAY_ADDRESS_ARG=()
fi

# 4. train: veRL's main_ppo behind our checks (refuses settings that would mistrain)
python -m memsearcher.integrations.verl.main \
  --config-path="$PWD/configs/verl" --config-name=grpo-qwen2.5-3b \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_files="$PWD/data/verl/train.parquet" \
  data.val_files="$PWD/data/verl/test.parquet" \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$PWD/configs/verl/agent_loop.yaml" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  actor_rollout_ref.rollout.agent.num_workers=$((8 * NNODES)) \
  +ray_kwargs.ray_init.runtime_env.env_vars.MEMSEARCHER_RETRIEVER="$RETRIEVER_URL" \
  "${RAY_ADDRESS_ARG[@]}" "$@"
