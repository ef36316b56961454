"""The answering process: filter and prioritize answered in a process of their own (issue 24).

kube-scheduler waits for filter and prioritize, one pod at a time, so their round trip bounds how fast the extender
path places pods. In one process they shared the event loop and the GIL with binds, watch decoding and cache
upkeep. With `--answer-process` (the default in cluster mode) `gpu-extender serve` runs two processes:
- the state process (the command itself) owns everything as before: watches, node cache, reservations, binds, job
  plans, metrics; it no longer listens on the API port itself;
- the answering process (extender.front.answering, started and restarted by extender.front.link) serves the API
  port with the same HTTP stack and answers the common filter and prioritize (a pod asking whole GPUs of the
  configured resource, of no job, nodeCacheCapable bodies) from a copy of the node states the state process
  streams to it as they change; every other request, binds among them, it passes to the state process whole, which
  runs it through the full app.

Only the state process reserves and binds, so no GPU is planned twice; the answering process holds no state of its
own that a restart would lose.
"""
