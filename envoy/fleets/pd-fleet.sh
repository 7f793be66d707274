#!/usr/bin/env bash
# A fleet file of ROLESETS vLLM prefill/decode rolesets of the demo model (`demo-llm`, port
# 18000, the demo fleet's config annotation), for measuring what fleet size costs:
#   envoy/fleets/pd-fleet.sh 128 > /tmp/fleet256.yaml
#   envoy/stack.sh up /tmp/fleet256.yaml 1 10000 native
# Pod addresses are 127.0.40.1 upward (250 per /24), clear of the demo fleet's 127.0.10.x.
set -euo pipefail
rolesets=${1:?usage: pd-fleet.sh ROLESETS}
printf 'apiVersion: v1\nkind: List\nitems:\n'
for ((i = 0; i < rolesets; i++)); do
  for role in prefill decode; do
    n=$((2 * i + $([ $role = prefill ] && echo 0 || echo 1)))
    cat <<YAML
- apiVersion: v1
  kind: Pod
  metadata:
    name: vllm-$role-$i
    namespace: demo
    labels: {model.aibrix.ai/name: demo-llm, model.aibrix.ai/port: "18000", model.aibrix.ai/engine: vllm, role-name: $role, roleset-name: group-$i}
    annotations:
      model.aibrix.ai/config: '{"profiles": {"default": {"routingStrategy": "pd"}}}'
  status:
    podIP: 127.0.$((40 + n / 250)).$((1 + n % 250))
    conditions: [{type: Ready, status: "True"}]
YAML
  done
done
