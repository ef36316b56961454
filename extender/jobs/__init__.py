"""Jobs of many pods: where the whole job should go (planner, pure) and its plans in the verbs (plans). Which job a
pod belongs to is extender.membership, a room below the state, so that the state indexes jobs without importing
this one."""
