"""What the extender knows of the cluster: the node cache, the reservations of in-flight plans, the pods' GPU needs,
the inventory (standalone mode) and the cluster source (watches and binds through the API server)."""
