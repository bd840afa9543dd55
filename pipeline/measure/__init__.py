"""One-off CPU measurements that decide recipe table entries (not part of the worker's path)."""
