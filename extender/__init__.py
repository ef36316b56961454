"""The kube-scheduler HTTP extender: topology-aware filter, prioritize, bind (with GPU plans) and preempt.

`gpu-extender serve` (extender.cli) runs extender.http.app over extender.service.Extender, fed by a cluster
(extender.state.cluster) or a standalone inventory (extender.state.inventory).
"""
