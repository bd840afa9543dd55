"""The farm's state in Redis: job records and their transitions, the worker registry, the
catalog index and the write side of the metrics.

Place in the data flow: submission writes job records here, workers move them through their
states and register themselves, the reaper recovers them, and the status API reads them.
Imports only the ``infra`` root (settings, schemas, keys, background).
"""
