"""The refit's two ends and what they share: the sender (`sender.py`), the receiver
(`receiver.py`), their common buffers and headers (`endpoint.py`), the setup and end-of-refit
exchanges (`handshake.py`) and the sender's per-bucket checks (`bucket_check.py`)."""
