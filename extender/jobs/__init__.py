"""Jobs of many pods: which job a pod belongs to (membership), and where the whole job should go (planner)."""
