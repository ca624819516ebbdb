"""The loading wing: RAM-efficient loading under FSDP (`fsdp`, public as `hsoffload.fsdp`) and DeepSpeed ZeRO-3
(`zero3`, public as `hsoffload.zero3_loading`).

Importing it loads the op library (`skip_init_non_rank0`, `skip_init_zero3`).
"""

from .._loader import load_library

load_library()
