"""Tensors owned by inductor's CUDA-graph trees (`torch.compile(mode="reduce-overhead")`).

AOTAutograd saves a cudagraphed forward's activations after the graph replay returned, outside any capture, so the
pack hook sees tensors that live in the tree's private memory pool. Copying them frees no device memory (the pool
keeps it for the next replay) and a later replay may overwrite the bytes while an asynchronous copy still reads
them; so they pass through untouched (counted with `captured_passthrough`, docs/design.md, "Graph capture").

How a tensor is recognised, cheapest first:
1. `torch._C._is_cached_tensor`: the outputs a tree hands out on replay are registered as cached tensors (only
   cudagraph_trees registers any).
2. The storage's address among the outputs recorded on the tree's current path (`current_node._path_from_root`,
   each node's `outputs_weakrefs`): warm-up and recording runs, and outputs that views alias. The path is cached per
   node (a node's path from the root never changes), the address set with it, rebuilt only when the path records
   more outputs.
The pack hook asks only about tensors the engine would offload (marked ones) and only once inductor's trees are
imported (`trees_loaded`), so a step without reduce-overhead compile pays nothing here.
3. Internals renamed in a later torch: torch's own per-node `_is_cuda_graph_recorded_tensor`; else not owned (the
   tensor is offloaded as before: what a torch without trees would do).
Never imports inductor: without `torch._inductor.cudagraph_trees` loaded, no tree exists.

Thread-safety: called from pack hooks on the forward thread; the cache is a WeakKeyDictionary written under the GIL.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_TREES = "torch._inductor.cudagraph_trees"
# tree node -> (weak references to its path from the root, output slots on that path when computed, storage addresses
# of those outputs); weak, so that the entry does not keep its own key alive
_path_addresses: "weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], int, frozenset[int]]]" = (
    weakref.WeakKeyDictionary()
)


def trees_loaded() -> bool:
    """True once inductor's CUDA-graph trees are imported (before that no tree exists to own memory)."""
    return _TREES in sys.modules


def owned_by_cudagraph_tree(t: torch.Tensor) -> bool:
    """True if `t`'s memory belongs to an inductor CUDA-graph tree (a cudagraphed graph's output or activation)."""
    return t.is_cuda and in_tree_memory(t, t.device.index)


def in_tree_memory(t: torch.Tensor, device_index: int) -> bool:
    """The device-independent part of `owned_by_cudagraph_tree` (tests call it with CPU tensors)."""
    trees = sys.modules.get(_TREES)
    if trees is None:
        return False
    is_cached = getattr(torch._C, "_is_cached_tensor", None)
    if is_cached is not None and is_cached(t):
        return True
    try:
        manager = trees.get_manager(device_index, create_if_none_exists=False)
        node = None if manager is None else manager.current_node
        if node is None:
            return False
        address = t.untyped_storage().data_ptr()
        return address != 0 and address in _addresses_on_path(node)
    except (AttributeError, TypeError):  # internals moved: torch's own (slower) helper, if it is still there
        try:
            node = trees.get_manager(device_index, False).current_node
            return bool(node is not None and node._is_cuda_graph_recorded_tensor(t))
        except (AttributeError, TypeError):
            return False


def _addresses_on_path(node: Any) -> frozenset[int]:
    cached = _path_addresses.get(node)
    path = [r() for r in cached[0]] if cached is not None else []
    if cached is None or any(n is None for n in path):
        path = list(node._path_from_root)
        cached = None
    slots = sum(len(n.outputs_weakrefs) for n in path)
    if cached is not None and cached[1] == slots:
        return cached[2]
    addresses = frozenset(ref.data_ptr() for n in path for ref in n.outputs_weakrefs if ref is not None)
    _path_addresses[node] = (tuple(weakref.ref(n) for n in path), slots, addresses)
    return addresses
