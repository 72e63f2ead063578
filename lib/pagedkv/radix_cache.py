"""SGLang's radix cache: a prefix cache that shares any number of tokens, not whole blocks.

vLLM finds a cached prefix by hashing each *full* block of token ids and
looking the hash up (``pagedkv.block_pool``): a prefix is shared in steps of
``block_size`` tokens. SGLang (Zheng et al., 2023) keeps a radix tree instead:

- Each edge (a ``TreeNode``) holds a run of token ids, its ``key``, and the
  KV slots those tokens were written to, its ``value`` (one int64 per token,
  the slots ``TokenToKVPoolAllocator`` handed out). The path from the root to
  a node spells a prefix; siblings never start with the same token, so one
  prefix has one path.
- ``match_prefix`` walks down as far as the tokens agree. When the match
  stops inside an edge, the edge is split in two, so the matched part becomes
  a node of its own that a request can lock.
- ``insert`` adds the part of a sequence the tree lacks as one new leaf and
  returns how much was already there: the caller frees its own copies of
  those slots (the tree keeps its own).
- ``inc_lock_ref``/``dec_lock_ref`` count the running requests using a node
  and every node above it. ``evict`` frees least-recently-used leaves with no
  lock, then their parents once those become unlocked leaves.

This is our code with SGLang 0.5.23's names and its LRU policy; SGLang's other
policies (LFU, FIFO, priority), EAGLE's bigram keys, LoRA namespaces, KV
events and host tiers are left out. Access times come from a logical clock
(one tick per ``match_prefix``/``insert`` call and one per new node, where
SGLang reads ``time.monotonic()``), so eviction order is reproducible.
``page_size > 1`` is SGLang's paged mode: keys are cut down to whole pages,
a child is found by its first page, and matches and splits fall on page
boundaries.

Invariants (``check()`` tests them all):

- sizes add up: ``evictable_size() + protected_size()`` is the number of
  tokens in the tree; a node's tokens are protected iff its ``lock_ref > 0``;
- a lock on a node is a lock on each ancestor, so ``lock_ref`` of a node is
  at least the sum over its children: a locked node's ancestors are locked,
  and eviction, which only takes unlocked nodes, never frees a slot a running
  request reads;
- only leaves are evicted: ``evictable_leaves`` is exactly the unlocked
  non-root nodes without children;
- every key is whole pages, a child is filed under its key's first page, and
  no slot appears twice in the tree.
"""

from __future__ import annotations

import heapq
import numbers
from typing import NamedTuple

import torch

from .common import check_int, require

__all__ = ["TreeNode", "RadixCache", "MatchResult", "InsertResult", "EvictResult"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the tree: ``key`` (token ids), ``value`` (their KV slots), ``lock_ref``."""

    def __init__(self, node_id: int, access_time: int):
        self.children: dict = {}  # child key (first token, or first page) -> TreeNode
        self.parent: TreeNode | None = None
        self.key: tuple[int, ...] = ()
        self.value: torch.Tensor = _EMPTY
        self.lock_ref = 0
        self.last_access_time = access_time  # logical clock, not wall time
        self.id = node_id

    def __lt__(self, other: TreeNode) -> bool:  # the eviction heap's order: least recent first
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        head = ",".join(map(str, self.key[:6])) + (",..." if len(self.key) > 6 else "")
        return f"TreeNode(id={self.id}, key=[{head}] ({len(self.key)}), lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # the KV slots of the matched prefix, in token order
    last_device_node: TreeNode  # the node where the match ends (the root on a miss)

    @property
    def device_prefix_len(self) -> int:
        return len(self.device_indices)


class InsertResult(NamedTuple):
    prefix_len: int  # tokens already in the tree: the caller frees its own slots for them
    last_device_node: TreeNode


class EvictResult(NamedTuple):
    num_tokens_evicted: int
    evicted: tuple[torch.Tensor, ...]  # each evicted leaf's slots, in eviction order


def _token_ids(key, name: str) -> tuple[int, ...]:
    """``key`` as a tuple of Python ints; anything else is refused by name."""
    if isinstance(key, torch.Tensor):
        if key.dim() != 1 or key.dtype.is_floating_point or key.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {key.dtype} of shape {tuple(key.shape)}")
        return tuple(key.tolist())
    if isinstance(key, (str, bytes)) or not hasattr(key, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(key).__name__} {key!r}")
    out = tuple(key)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] = {t!r} is not an int")
        if t < 0:
            raise ValueError(f"{name}[{i}] = {t} is negative")
    return tuple(int(t) for t in out)


class RadixCache:
    """A radix tree from token ids to KV slots, with lock counts and LRU leaf eviction.

    ``token_to_kv_pool_allocator``, if given, gets each evicted leaf's slots
    through ``free_segment(slots, start_pos=0)``, as in SGLang; either way
    ``evict`` returns them.
    """

    def __init__(self, page_size: int = 1, token_to_kv_pool_allocator=None):
        self.page_size = check_int(page_size, "page_size", 1)
        if token_to_kv_pool_allocator is not None and not callable(
                getattr(token_to_kv_pool_allocator, "free_segment", None)):
            raise TypeError("token_to_kv_pool_allocator must have a free_segment(slots, start_pos=...) method, "
                            f"got {type(token_to_kv_pool_allocator).__name__}")
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.reset()

    def reset(self) -> None:
        self._clock = 0
        self._next_id = 0
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1  # the root is never evictable and never counted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        # An insertion-ordered set: unlocked non-root nodes without children.
        self.evictable_leaves: dict[TreeNode, None] = {}
        self._slots: set[int] = set()  # every slot the tree holds, to refuse a slot given twice

    # ---------------------------------------------------------------- the clock and nodes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self) -> TreeNode:
        node = TreeNode(self._next_id, self._tick())
        self._next_id += 1
        return node

    def _child_key(self, key: tuple[int, ...]):
        """Where a child whose key starts with ``key`` is filed: its first token, or its first page."""
        return key[0] if self.page_size == 1 else key[: self.page_size]

    def _match_len(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """The tokens ``a`` and ``b`` share from the start, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _aligned(self, key, name: str) -> tuple[int, ...]:
        ids = _token_ids(key, name)
        return ids[: len(ids) - len(ids) % self.page_size]

    # ---------------------------------------------------------------- the public API

    def match_prefix(self, key) -> MatchResult:
        """The longest cached prefix of ``key`` (cut to whole pages): its slots and last node.

        Marks the path as just used. A match ending inside an edge splits that
        edge, so the returned node covers exactly the matched tokens.
        """
        key = self._aligned(key, "key")
        if not key:
            return MatchResult(_EMPTY.clone(), self.root_node)
        value, node = self._match_prefix_helper(self.root_node, key)
        return MatchResult(torch.cat(value) if value else _EMPTY.clone(), node)

    def insert(self, key, value) -> InsertResult:
        """Cache ``key``'s tokens at the slots ``value`` (one per token; extra slots ignored).

        Returns how many leading tokens the tree already held: their slots in
        ``value`` are the caller's to free, the tree keeps its own. The rest
        become one new leaf, evictable until someone locks it.
        """
        key = self._aligned(key, "key")
        if isinstance(value, torch.Tensor):
            if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
                raise TypeError(f"value must be a 1-D integer tensor, got {value.dtype} "
                                f"of shape {tuple(value.shape)}")
            slots = value.detach().to("cpu", torch.int64)
        else:
            slots = torch.tensor(_token_ids(value, "value"), dtype=torch.int64)
        if len(slots) < len(key):
            raise ValueError(f"value has {len(slots)} slots for a key of {len(key)} tokens "
                             f"(page_size {self.page_size}); each token needs one")
        slots = slots[: len(key)].clone()
        if len(slots) and int(slots.min()) < 0:
            raise ValueError(f"value holds the negative slot {int(slots.min())}")
        # Refuse before changing anything: find the new part by a walk that splits nothing.
        new = slots[self._cached_len(key):].tolist()
        if len(set(new)) != len(new):
            dup = next(s for i, s in enumerate(new) if s in new[:i])
            raise ValueError(f"slot {dup} appears twice in the new part of value")
        held = [s for s in new if s in self._slots]
        if held:
            raise ValueError(f"slot {held[0]} is already in the tree under another token; "
                             "a slot holds one token's K/V")
        prefix_len, node = self._insert_helper(self.root_node, key, slots)
        return InsertResult(prefix_len, node)

    def evict(self, num_tokens: int) -> EvictResult:
        """Free at least ``num_tokens`` tokens (or all that can go), least recently used leaf first.

        A leaf goes whole, so more than ``num_tokens`` may be freed. A parent
        left childless and unlocked joins the candidates at once.
        """
        num_tokens = check_int(num_tokens, "num_tokens", 0)
        heap = [(node.last_access_time, node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted, evicted = 0, []
        while num_evicted < num_tokens and heap:
            _, x = heapq.heappop(heap)
            if self.token_to_kv_pool_allocator is not None:
                self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
            evicted.append(x.value)
            num_evicted += len(x.value)
            self._delete_leaf(x)
            if not x.parent.children and x.parent.lock_ref == 0:
                heapq.heappush(heap, (x.parent.last_access_time, x.parent))
        return EvictResult(num_evicted, tuple(evicted))

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors for one more user; returns the change in evictable_size."""
        self._check_attached(node, "inc_lock_ref")
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:  # its tokens move from evictable to protected
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the change in evictable_size."""
        self._check_attached(node, "dec_lock_ref")
        if node is not self.root_node and node.lock_ref == 0:
            raise ValueError(f"dec_lock_ref: {node!r} is not locked; each dec_lock_ref undoes one inc_lock_ref")
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 1:  # its last user leaves: evictable again
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return sum(len(n.key) for n in self.nodes())

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """The slots on the path from the root to ``node``."""
        self._check_attached(node, "path_device_indices")
        values = []
        while node is not self.root_node:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else _EMPTY.clone()

    def nodes(self):
        """Every node but the root, parents before children, children in insertion order."""
        stack = list(reversed(self.root_node.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def index_bytes(self) -> int:
        """Bytes of the index itself: each cached token's id and its slot, 8 bytes each as in SGLang.

        Node objects and dict entries come on top (a per-node cost, not per token).
        """
        return sum(8 * len(n.key) + n.value.element_size() * len(n.value) for n in self.nodes())

    def format_tree(self, width: int = 77) -> str:
        """The tree as indented text, one node a line: its tokens, slots and lock count."""
        lines = ["root"]

        def show(xs):
            return " ".join(map(str, xs))

        def walk(node, depth):
            for child in node.children.values():
                text = (f"{'  ' * depth}+- [{show(child.key)}] slots [{show(child.value.tolist())}]"
                        f" lock {child.lock_ref}")
                lines.append(text if len(text) <= width else text[: width - 3] + "...")
                walk(child, depth + 1)

        walk(self.root_node, 1)
        return "\n".join(lines)

    # ---------------------------------------------------------------- SGLang's helpers

    def _match_prefix_helper(self, node: TreeNode, key: tuple[int, ...]):
        access_time = self._tick()
        node.last_access_time = access_time
        value = []
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access_time = access_time
            prefix_len = self._match_len(child.key, key)
            if prefix_len < len(child.key):  # the match ends inside this edge: split it there
                new_node = self._split_node(child, prefix_len)
                value.append(new_node.value)
                node = new_node
                break
            value.append(child.value)
            node = child
            key = key[prefix_len:]
        return value, node

    def _cached_len(self, key: tuple[int, ...]) -> int:
        """How many tokens of ``key`` the tree holds, changing nothing (no split, no access time)."""
        node, n = self.root_node, 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            m = self._match_len(node.key, key)
            n += m
            if m < len(node.key):
                break
            key = key[m:]
        return n

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """parent -> child becomes parent -> new_node (child's first split_len tokens) -> child.

        The new node takes the child's lock count (whoever locked the child
        holds the whole path) and its place among the parent's children.
        """
        new_node = self._new_node()
        new_node.children = {self._child_key(child.key[split_len:]): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len].clone()
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        new_node.parent.children[self._child_key(new_node.key)] = new_node
        return new_node  # sizes are unchanged: the same tokens, with the same lock count

    def _insert_helper(self, node: TreeNode, key: tuple[int, ...], value: torch.Tensor):
        access_time = self._tick()
        node.last_access_time = access_time
        total_prefix_length = 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            node.last_access_time = access_time
            prefix_len = self._match_len(node.key, key)
            total_prefix_length += prefix_len
            key, value = key[prefix_len:], value[prefix_len:]
            if prefix_len < len(node.key):
                node = self._split_node(node, prefix_len)
        if key:
            new_node = self._new_node()
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone()
            node.children[self._child_key(key)] = new_node
            self.evictable_size_ += len(key)
            self._slots.update(new_node.value.tolist())
            self._update_leaf_status(node)  # its parent is a leaf no more
            self._update_leaf_status(new_node)
            node = new_node
        return total_prefix_length, node

    def _delete_leaf(self, node: TreeNode) -> None:
        del node.parent.children[self._child_key(node.key)]
        self.evictable_size_ -= len(node.key)
        self._slots.difference_update(node.value.tolist())
        self.evictable_leaves.pop(node, None)
        self._update_leaf_status(node.parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node.lock_ref > 0 or node.children:
            self.evictable_leaves.pop(node, None)
        else:
            self.evictable_leaves[node] = None

    def _check_attached(self, node, op: str) -> None:
        """Refuse a node that is not in this tree (another tree's, or evicted), by name."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{op}: node must be a TreeNode, got {type(node).__name__}")
        x = node
        while x is not self.root_node:
            p = x.parent
            if p is None or p.children.get(self._child_key(x.key)) is not x:
                raise ValueError(f"{op}: {node!r} is not in this tree (evicted, or another tree's)")
            x = p

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant (see the module docstring)."""
        evictable = protected = 0
        leaves, slots = set(), []
        for node in self.nodes():
            require(node.parent is not None and node.parent.children.get(self._child_key(node.key)) is node,
                    "a child is filed under its key's first page", lambda: repr(node))
            require(len(node.key) > 0 and len(node.key) % self.page_size == 0 and len(node.value) == len(node.key),
                    "a key is whole pages with one slot per token", lambda: repr(node))
            require(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                    "a lock on a node is a lock on each ancestor", lambda: repr(node))
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
            slots += node.value.tolist()
        require(self.root_node.lock_ref >= 1, "the root is locked", self.root_node.lock_ref)
        require((evictable, protected) == (self.evictable_size_, self.protected_size_),
                "sizes add up", lambda: f"counted evictable {evictable}, protected {protected}; "
                f"kept {self.evictable_size_}, {self.protected_size_}")
        require(leaves == set(self.evictable_leaves), "only unlocked leaves are evictable",
                lambda: f"{sorted(n.id for n in leaves)} vs {sorted(n.id for n in self.evictable_leaves)}")
        require(len(slots) == len(set(slots)) and set(slots) == self._slots, "no slot appears twice in the tree",
                lambda: f"{len(slots)} slots, {len(set(slots))} distinct, {len(self._slots)} kept")

