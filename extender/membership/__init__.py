"""Which job a pod belongs to and how many pods the job has: the lowest room of the extender, read by the state
(its cache indexes pods per job), the configuration (the owner kinds watched) and the job planning above them."""
