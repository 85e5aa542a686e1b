"""A radix tree over token sequences whose nodes carry marks: `mark(tokens, depths, key)` puts `key` at each of
`depths` along `tokens`' path, and `walk(prompt, limit)` returns the marks on the prompt's path (the places a
prompt can resume from) and how far the prompt follows the tree. Edges are int32 arrays compared in numpy, so a
lookup costs the prompt's length plus the nodes it passes, whatever the number of sequences held (SGLang's
RadixCache, with marks where an entry is usable instead of pages)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Node:
    edge: np.ndarray  # the tokens from the parent to this node
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)  # by the first token of their edge
    marks: set[Hashable] = field(default_factory=set)


@dataclass(frozen=True)
class Walk:
    """Where a prompt meets the tree: `marks` [(depth, key)] on its path (depth <= the walk's limit, shallow
    first); `depth`, how many of its tokens the tree holds; `below`, a key whose sequence runs through that depth."""

    marks: list[tuple[int, Hashable]]
    depth: int
    below: Hashable | None


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class RadixTree:
    def __init__(self) -> None:
        self.root = Node(np.empty(0, np.int32), None)
        self.n_nodes = 1

    def mark(self, tokens: np.ndarray, depths: list[int], key: Hashable) -> list[Node]:
        """Put `key` at each of `depths` (1..len(tokens)) along the path of `tokens`, splitting edges so that a
        node sits at each; the marked nodes, to `unmark` later."""
        nodes, node, depth = [], self.root, 0
        for target in sorted(set(depths)):
            node, depth = self._reach(node, depth, tokens, target)
            node.marks.add(key)
            nodes.append(node)
        return nodes

    def unmark(self, nodes: list[Node], key: Hashable) -> None:
        """Take `key` off `nodes`, pruning what no longer leads to a mark."""
        for node in reversed(nodes):  # deepest first: a pruned leaf may leave its parent a leaf
            node.marks.discard(key)
            self._prune(node)

    def walk(self, prompt: np.ndarray, limit: int) -> Walk:
        """The marks on the path of `prompt[:limit]` and how far it follows the tree."""
        marks: list[tuple[int, Hashable]] = []
        node, depth = self.root, 0
        below: Node | None = node
        while depth < limit:
            child = node.children.get(int(prompt[depth]))
            if child is None:
                break
            n = _common(child.edge, prompt[depth : min(limit, depth + len(child.edge))])
            depth += n
            if n < len(child.edge):
                below = child  # partway along its edge: every sequence below it runs through `depth`
                break
            node = below = child
            marks.extend((depth, key) for key in node.marks)
        return Walk(marks, depth, self._any_mark(below) if depth else None)

    def _reach(self, node: Node, depth: int, tokens: np.ndarray, target: int) -> tuple[Node, int]:
        """The node at `target` along `tokens` from `node` (at `depth`), made where missing."""
        while depth < target:
            first = int(tokens[depth])
            child = node.children.get(first)
            if child is None:
                child = Node(tokens[depth:target].copy(), node)
                node.children[first] = child
                self.n_nodes += 1
                return child, target
            n = _common(child.edge, tokens[depth:target])
            if n < len(child.edge):  # split the edge at n
                middle = Node(child.edge[:n].copy(), node, {int(child.edge[n]): child})
                child.edge, child.parent = child.edge[n:].copy(), middle
                node.children[first] = middle
                self.n_nodes += 1
                child = middle
            node, depth = child, depth + n
        return node, depth

    def _prune(self, node: Node) -> None:
        """Remove unmarked leaves up from `node`; fold an unmarked node with one child into it."""
        while node.parent is not None and not node.marks and not node.children:
            parent = node.parent
            del parent.children[int(node.edge[0])]
            self.n_nodes -= 1
            node = parent
        if node.parent is not None and not node.marks and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = np.concatenate((node.edge, child.edge))
            child.parent = node.parent
            node.parent.children[int(node.edge[0])] = child
            self.n_nodes -= 1

    @staticmethod
    def _any_mark(node: Node | None) -> Hashable | None:
        """A key marked at or below `node` (every leaf is marked)."""
        while node is not None and not node.marks:
            node = next(iter(node.children.values()), None)
        return next(iter(node.marks)) if node is not None else None
