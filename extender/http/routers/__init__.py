"""The extender's HTTP routes, one router per resource: the scheduler verbs, health, and the standalone inventory."""
