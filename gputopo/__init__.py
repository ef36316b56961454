"""The library both halves stand on: the pure core, discovery, the Kubernetes client layer, logging, and the
contract (names on the cluster and the plan format). It imports neither the plugin nor the extender."""
