"""The worker process: one accelerator, one warm pipeline, one pool's queue.

Place in the data flow: queue → **worker** (consume batches, heartbeat, circuit breaker, the batch
runner with its render and post stages) → pipeline → storage → job-state store. The process is
made of parts started and stopped in order (:mod:`worker.main`). The pipeline's lifecycle (load,
optimize, warm up, size the batch) is :mod:`pipeline.warm`'s; the worker keeps only the process
around it.
"""
