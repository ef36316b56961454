"""Where a pod's GPUs go on one node, and why: the policy (best subset, packing and island values), its memo, the
reasons for a refusal, the score scale and the one-line explanation. Reads the node cache, never writes it."""
