"""What both sides read about an engine: its configuration (`config.py`) and its refit state
(`state.py`)."""
