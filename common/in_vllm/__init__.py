"""Runs inside vLLM's processes: the `refit` weight-transfer backend, the learned load map and
its direct apply, and the hosts of an `LLM` / `AsyncLLM`. The only room that imports vllm."""
