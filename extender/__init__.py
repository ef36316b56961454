"""The kube-scheduler HTTP extender: topology-aware filter, prioritize, bind (with GPU plans) and preempt.

`gpu-extender serve` (extender.cli) runs extender.app over extender.service.Extender, fed by a cluster
(extender.cluster) or a standalone inventory (extender.inventory).
"""
