"""The offload wing: the scope and its config, the policies (what is marked), the transformers patch, the host pool
and budget, and the saved-tensor helpers they need (SAC, pass-throughs, CUDA-graph capture, autograd tasks).

Importing it loads the op library: the modules here reach it through the one door, `hsoffload.engine`.
"""

from .._loader import load_library

load_library()
