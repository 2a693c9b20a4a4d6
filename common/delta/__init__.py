"""Delta refits: the lossless codec (`codec.py`), which frames go as deltas and their wire form
(`frames.py`), the trainers' shadows, the workers' bases and the undo log (`store.py`)."""
