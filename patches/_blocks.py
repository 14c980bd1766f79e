"""Readers of the host's objects for the block accounting (:mod:`fdsched.core.blocks`): the block ids the prefix cache
holds and those each request holds. Shared by the replay (after every step) and the engine's guard (now and then).
They read attributes only; nothing here imports FastDeploy."""

from __future__ import annotations

__all__ = ["cache_held_blocks", "cache_blocks_by_node", "request_held_blocks"]


def cache_held_blocks(cache_manager) -> list:
    """GPU block ids the prefix cache holds: :func:`cache_blocks_by_node`'s two lists as one."""
    nodes, others = cache_blocks_by_node(cache_manager)
    nodes.extend(others)
    return nodes


def cache_blocks_by_node(cache_manager) -> tuple:
    """GPU block ids the prefix cache holds (see :mod:`fdsched.core.blocks`), as ``(node ids, other ids)``: the
    ``block_id`` of every GPU node (one entry per node, so an id two nodes hold is there twice), and the reserved
    decode ids and unfilled blocks.

    Every node below the root, plus every node reachable upwards from a leaf the cache still tracks.
    Written for speed (the replay may call it every step): the GPU status member is looked up once
    and compared by identity.
    """
    root = cache_manager.radix_tree_root
    gpu = _gpu_status(root)
    nodes, others = [], list(getattr(root, "reverved_dec_block_ids", None) or [])
    append, extend = nodes.append, others.extend
    # Nodes hash by identity (the host defines no __eq__), so a set of nodes is a set of identities.
    seen = {root}
    stack = list(root.children.values())
    while stack:  # the tree below the root
        node = stack.pop()
        seen.add(node)
        if node.cache_status is gpu:
            append(node.block_id)
            reserved = getattr(node, "reverved_dec_block_ids", None)  # 2.2's nodes have none
            if reserved:
                extend(reserved)
        children = node.children
        if children:
            stack.extend(children.values())
    leaves = list(getattr(cache_manager, "gpu_lru_leaf_set", ())) + list(getattr(cache_manager, "req_leaf_map", {}).values())
    for node in leaves:  # nodes the cache tracks that are no longer attached below the root
        while node is not None and node not in seen:
            seen.add(node)
            if node.cache_status is gpu:
                append(node.block_id)
                reserved = getattr(node, "reverved_dec_block_ids", None)
                if reserved:
                    extend(reserved)
            node = node.parent
    for ids in getattr(cache_manager, "unfilled_req_block_map", {}).values():
        extend(ids)
    return nodes, others


def _gpu_status(node):
    """The host's ``CacheStatus.GPU`` member (found from the class of a node's status)."""
    return type(node.cache_status).GPU


def request_held_blocks(requests) -> dict:
    """Request id -> the block ids it holds (its ``block_tables`` and ``extend_block_tables``), for those holding any."""
    held = {}
    for request in requests:
        ids = list(request.block_tables or [])
        ids.extend(getattr(request, "extend_block_tables", None) or [])
        if ids:
            held[request.request_id] = ids
    return held
