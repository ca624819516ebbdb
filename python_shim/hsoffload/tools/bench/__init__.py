"""`hsoffload bench`: the CPU suite (`cpu.py`), the GPU suite (`gpu.py`), the peers they compare
(`peers.py`) and shared helpers (`common.py`). Importing this package imports no GPU-only code."""
