"""Shard-to-shard: what a worker needs of each bucket (`needs.py`), need-sets and the compact
frames' gathers (`plan.py`), the compact frame buffers (`frames.py`), the needs exchange and
re-plan at each refit's start (`replan.py`)."""
