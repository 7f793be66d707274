#!/usr/bin/env bash
# A fleet file of ROLESETS vLLM prefill/decode rolesets of the demo model (`demo-llm`, port
# 18000, the demo fleet's config annotation), each of one prefill pod and DECODES decode pods
# (default 1), for measuring what fleet size costs, or, with DECODES 2, what a decode pod with
# a sibling to stand in for it changes (docs/OPERATOR.md "Stand-in pods"):
#   envoy/fleets/pd-fleet.sh 128 > /tmp/fleet256.yaml
#   envoy/fleets/pd-fleet.sh 2 2 > /tmp/siblings.yaml
#   envoy/stack.sh up /tmp/fleet256.yaml 1 10000 native
# Pod addresses are 127.0.40.1 upward (250 per /24), clear of the demo fleet's 127.0.10.x.
# With DECODES 1 the pods are named vllm-prefill-I and vllm-decode-I; with more, the decode
# pods are vllm-decode-I-J.
set -euo pipefail
rolesets=${1:?usage: pd-fleet.sh ROLESETS [DECODES]}
decodes=${2:-1}
printf 'apiVersion: v1\nkind: List\nitems:\n'
for ((i = 0; i < rolesets; i++)); do
  for ((j = 0; j <= decodes; j++)); do
    n=$((i * (decodes + 1) + j))
    if ((j == 0)); then
      role=prefill name=vllm-prefill-$i
    else
      role=decode name=vllm-decode-$i
      ((decodes == 1)) || name+=-$((j - 1))
    fi
    cat <<YAML
- apiVersion: v1
  kind: Pod
  metadata:
    name: $name
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
