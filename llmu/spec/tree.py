"""Tree speculation: verify a whole tree of drafts in one target pass (SpecInfer, Medusa, EAGLE).

A chain of proposals dies at its first wrong token. A **tree** hedges: node ``i`` holds one
proposed token and the index of its parent, ``parents[i]``; ``-1`` means "the last accepted
token", so every path from the top of the tree down to a node is one possible continuation of the
context. Nodes come in topological order (a parent before its children: ``parents[i] < i``).

The target scores every node in **one** forward pass. Its input is the context's tokens the cache
does not hold yet, then the tree's tokens, with two changes to a plain causal pass:

- **positions**: node ``i`` sits at ``L + depth(i)`` (``L`` the context's length, ``depth`` 0 for
  a child of the last accepted token), not at ``L + i``: it is the ``depth(i)``-th token of its
  own continuation, whatever the nodes before it in the list are;
- **the attention mask** (:func:`tree_mask`): node ``i`` sees the committed context and its own
  ancestors and itself, never a sibling or a cousin. With this mask the logits of node ``i`` are
  exactly those a causal pass over ``context + path(i)`` would give.

Greedy verification (:func:`accept_path`): node ``i`` is accepted when its token is the target's
argmax at its **parent** (at the last context token for a depth-0 node) and its parent was
accepted; the step keeps the deepest accepted node's path and adds one token of the target's own,
its argmax at that node (the bonus). The output is plain greedy decoding's, token for token.

The cache: the pass appends the keys and values of every node at ``L .. L + T - 1``. The nodes of
the accepted path are not contiguous there; :func:`verify_greedy` copies theirs to ``L .. L + n - 1``
and crops the rest. Their keys and values are already the right ones (each node was computed at its
true position, seeing only its path), so nothing is fed again.

:func:`tree_generate` is the loop around a step; :class:`NGramTreeDraft` builds trees by prompt
lookup (several earlier occurrences of the context's last words, merged into a trie). Because
greedy verification is deterministic, :func:`replay_tree` reads what each step of the loop accepts
off the target's known greedy answer, without running the target: how notebook 11 compares tree
shapes at no cost (after one real run that agrees with the replay step by step). For tests,
:func:`answer_draft` proposes trees with right and wrong nodes where the answer is known, and
:class:`PassCounter` counts a model's forward passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["check_tree", "tree_depths", "tree_mask", "tree_positions", "tree_attention", "accept_path",
           "verify_greedy", "tree_generate", "replay_tree", "TreeRun", "chain_parents", "NGramTreeDraft", "trie",
           "answer_draft", "PassCounter"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_tree(parents: Sequence[int], tokens: Sequence[int] | None = None) -> list[int]:
    """``parents`` as a list of ints, checked: each ``-1`` or the index of an earlier node
    (``-1 <= parents[i] < i``); ``tokens``, when given, one int per node. ``ValueError`` otherwise."""
    if isinstance(parents, torch.Tensor):
        parents = parents.tolist()
    parents = list(parents)
    for i, p in enumerate(parents):
        if not _is_int(p):
            raise ValueError(f"parents must hold ints, got {p!r} at node {i}")
        if p < -1:
            raise ValueError(f"parents[{i}] = {p}: a parent is -1 (the last accepted token) or a node index")
        if p >= i:
            raise ValueError(f"parents[{i}] = {p}: a node's parent must come before it (parents[i] < i, "
                             "nodes in topological order)")
    if tokens is not None:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        if len(tokens) != len(parents):
            raise ValueError(f"parents and tokens need one entry per node: lengths {len(parents)} and {len(tokens)}")
        for i, t in enumerate(tokens):
            if not _is_int(t) or t < 0:
                raise ValueError(f"tokens must hold token ids (ints >= 0), got {t!r} at node {i}")
    return parents


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 0 for a child of the last accepted token, its parent's depth + 1 otherwise."""
    parents = check_tree(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p == -1 else depth[p] + 1)
    return depth


def _check_prefix(prefix_len) -> int:
    if not _is_int(prefix_len) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
    return prefix_len


def tree_mask(parents: Sequence[int], prefix_len: int = 0) -> torch.Tensor:
    """``(T, prefix_len + T)`` bool, True = attend: row ``i`` sees the ``prefix_len`` committed
    tokens, then (column ``prefix_len + j``) node ``j`` exactly when ``j`` is ``i`` or one of its
    ancestors."""
    parents = check_tree(parents)
    prefix_len = _check_prefix(prefix_len)
    t = len(parents)
    mask = torch.zeros(t, prefix_len + t, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i, p in enumerate(parents):
        mask[i, prefix_len + i] = True
        if p >= 0:
            mask[i, prefix_len:] |= mask[p, prefix_len:]     # the parent's row holds all its ancestors
    return mask


def tree_positions(parents: Sequence[int], prefix_len: int = 0) -> torch.Tensor:
    """``(T,)`` int64: node ``i`` at position ``prefix_len + depth(i)``."""
    depth = tree_depths(parents)
    return _check_prefix(prefix_len) + torch.tensor(depth, dtype=torch.long)


def tree_attention(parents: Sequence[int], prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tree_mask(parents, prefix_len), tree_positions(parents, prefix_len))``."""
    return tree_mask(parents, prefix_len), tree_positions(parents, prefix_len)


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of ``n`` nodes, ``[-1, 0, 1, ..., n - 2]``: ordinary speculation."""
    if not _is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return list(range(-1, n - 1))


def accept_path(parents: Sequence[int], tokens: Sequence[int], predicted: Sequence[int]) -> list[int]:
    """Greedy acceptance on a tree: the node indices, top to bottom, of the longest accepted path.

    ``predicted`` holds ``T + 1`` token ids: the target's argmax after the last context token,
    then after each node. Node ``i`` is accepted when ``tokens[i] == predicted[parents[i] + 1]``
    (its parent's prediction) and its parent is accepted (or is ``-1``). Of the accepted nodes the
    deepest wins, the one with the lower index between equally deep ones; ``[]`` when none is.
    """
    parents = check_tree(parents, tokens)
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    predicted = predicted.tolist() if isinstance(predicted, torch.Tensor) else list(predicted)
    if len(predicted) != len(parents) + 1:
        raise ValueError(f"predicted needs T + 1 = {len(parents) + 1} entries (after the context and after each "
                         f"node), got {len(predicted)}")
    ok, depth, best = [], [], -1
    for i, p in enumerate(parents):
        ok.append(tokens[i] == predicted[p + 1] and (p == -1 or ok[p]))
        depth.append(0 if p == -1 else depth[p] + 1)
        if ok[i] and (best == -1 or depth[i] > depth[best]):
            best = i
    path = []
    while best != -1:
        path.append(best)
        best = parents[best]
    return path[::-1]


@torch.no_grad()
def verify_greedy(model, cache, context: Sequence[int], parents: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """One greedy tree step: the accepted tokens of the tree and the target's bonus token.

    ``cache`` (a ``KVCache`` of batch 1) holds the keys and values of ``context[:cache.length]``,
    with ``cache.length < len(context)``. One forward pass of ``model`` feeds the rest of the
    context, then the tree's tokens at their positions (:func:`tree_positions`) under the tree's
    mask (:func:`tree_mask`). Afterwards the cache holds ``context`` and the accepted tokens: every
    token returned but the last, whose keys and values the next step computes.
    """
    parents = check_tree(parents, tokens)
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    context = [int(t) for t in context]
    n_ctx, held, t = len(context), cache.length, len(parents)
    if not held < n_ctx:
        raise ValueError(f"the cache holds {held} positions but the context has {n_ctx} tokens: it must hold "
                         "fewer (the last context token is always fed, its logits score the tree)")
    feed = context[held:]
    f = len(feed)
    # -- the pass: feed rows are causal over the context; tree rows see the context and their path
    mask = torch.zeros(f + t, n_ctx + t, dtype=torch.bool)
    mask[:f, :n_ctx] = True                  # the causal mask, ANDed in by the model, keeps them causal
    mask[f:] = tree_mask(parents, n_ctx)
    positions = torch.cat([torch.arange(held, n_ctx), tree_positions(parents, n_ctx)])
    ids = torch.tensor([feed + tokens], device=model.device)
    out = model(ids, cache=cache, position_ids=positions[None].to(model.device),
                attention_mask=mask[None, None].to(model.device))
    predicted = out.logits[0, f - 1:].argmax(-1).tolist()      # after the last context token, then each node
    path = accept_path(parents, tokens, predicted)
    # -- keep the accepted nodes' keys and values, moved next to the context; forget the rest
    if path:
        src = torch.tensor(path, device=cache.k[0].device) + n_ctx
        dst = torch.arange(n_ctx, n_ctx + len(path), device=src.device)
        for layer in range(cache.num_layers):
            cache.k[layer][:, :, dst] = cache.k[layer][:, :, src]
            cache.v[layer][:, :, dst] = cache.v[layer][:, :, src]
    cache.crop(n_ctx + len(path))
    return [tokens[i] for i in path] + [predicted[path[-1] + 1 if path else 0]]


@dataclass
class TreeRun:
    """What :func:`tree_generate` did: the new tokens and, per step, the tree's size and how many of
    its nodes were accepted (a step emits ``accepted + 1`` tokens)."""

    tokens: list[int]
    nodes: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Target passes (one a step)."""
        return len(self.nodes)

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target pass (those past the budget included: the pass made them)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else float("nan")


def tree_generate(model, step: Callable, draft: Callable, prompt: Sequence[int], max_new_tokens: int, *,
                  max_nodes: int = 64) -> TreeRun:
    """``max_new_tokens`` greedy tokens after ``prompt``, a tree step at a time.

    ``draft(context)`` returns ``(parents, tokens)``, a tree of at most ``max_nodes`` nodes (an empty
    one makes a plain decoding step); ``step(model, cache, context, parents, tokens)`` verifies it
    (:func:`verify_greedy` has that signature) and returns the new tokens, after which the cache must
    hold the context and all new tokens but the last.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    for name, v in (("max_new_tokens", max_new_tokens), ("max_nodes", max_nodes)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    cache = model.new_cache(batch_size=1, max_len=len(prompt) + max_new_tokens + max_nodes)
    context, run = list(prompt), TreeRun([])
    while len(run.tokens) < max_new_tokens:
        parents, tokens = draft(context)
        parents, tokens = list(parents), list(tokens)
        if len(parents) > max_nodes:
            raise ValueError(f"the draft returned a tree of {len(parents)} nodes; max_nodes is {max_nodes}")
        new = step(model, cache, list(context), parents, tokens)
        if not isinstance(new, (list, tuple)) or not new or not all(_is_int(x) for x in new):
            raise ValueError(f"a step returns a non-empty list of token ids (the accepted ones and the bonus), "
                             f"got {new!r}")
        if cache.length != len(context) + len(new) - 1:
            raise ValueError(f"after a step the cache must hold the context and every new token but the last: "
                             f"{len(context)} + {len(new)} - 1 = {len(context) + len(new) - 1} positions, it holds "
                             f"{cache.length}")
        run.nodes.append(len(parents))
        run.accepted.append(len(new) - 1)
        context += list(new)
        run.tokens += list(new)
    run.tokens = run.tokens[:max_new_tokens]
    return run


def trie(branches: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """``(parents, tokens)`` of the tree that holds every branch (a token sequence) as a path from
    the top, shared prefixes stored once; nodes in the order they are first needed."""
    parents, tokens = [], []
    children: dict[tuple[int, int], int] = {}
    for branch in branches:
        at = -1
        for tok in branch:
            key = (at, int(tok))
            if key not in children:
                children[key] = len(tokens)
                parents.append(at)
                tokens.append(int(tok))
            at = children[key]
    return parents, tokens


class NGramTreeDraft:
    """Prompt lookup as a tree: the continuations of up to ``width`` earlier occurrences of the
    context's last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``, latest occurrence
    first, continuations that differ from the ones taken), merged into a trie (:func:`trie`).

    ``nodes`` bounds the tree: each continuation is cut to ``nodes // width`` tokens, the first
    (the latest occurrence, which :class:`~llmu.spec.drafts.NGramDraft` would propose alone) gets
    the remainder. ``width=1`` is the chain of ``NGramDraft`` with ``gamma = nodes``.
    """

    def __init__(self, width: int, nodes: int, max_ngram: int = 3, min_ngram: int = 1):
        for name, v in (("width", width), ("nodes", nodes), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if width > nodes:
            raise ValueError(f"width ({width}) cannot exceed nodes ({nodes})")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.width, self.nodes, self.max_ngram, self.min_ngram = width, nodes, max_ngram, min_ngram
        self.name = f"prompt-lookup tree (width {width}, {nodes} nodes)"

    def continuations(self, context: Sequence[int]) -> list[list[int]]:
        """Up to ``width`` different continuations, best first."""
        ctx = [int(t) for t in context]
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] != suffix:
                    continue
                cont = ctx[start + n:start + n + self.nodes]
                if cont and all(cont[:len(f)] != f[:len(cont)] for f in found):
                    found.append(cont)
                    if len(found) == self.width:
                        return found
        return found

    def __call__(self, context: Sequence[int]) -> tuple[list[int], list[int]]:
        found = self.continuations(context)
        if not found:
            return [], []
        each = self.nodes // self.width
        first = self.nodes - each * (len(found) - 1)
        return trie([found[0][:first]] + [c[:each] for c in found[1:]])


def replay_tree(draft: Callable, prompt: Sequence[int], answer: Sequence[int], max_new_tokens: int) -> TreeRun:
    """What :func:`tree_generate` does with ``draft`` and a greedy target whose greedy ``answer`` to
    ``prompt`` is known, without running the target: greedy verification is deterministic, so a node
    is accepted exactly when its path spells the answer's next tokens. ``max_new_tokens`` must leave
    one token of ``answer`` after it (the bonus of the last step)."""
    prompt, answer = [int(t) for t in prompt], [int(t) for t in answer]
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens < len(answer):
        raise ValueError(f"max_new_tokens must be an int in 1..len(answer) - 1 = {len(answer) - 1}, "
                         f"got {max_new_tokens!r}")
    run, k = TreeRun([]), 0
    while k < max_new_tokens:
        parents, tokens = draft(prompt + answer[:k])
        depth = tree_depths(parents)
        known = [answer[k + d + 1] if k + d + 1 < len(answer) else -1 for d in depth]
        path = accept_path(parents, tokens, [answer[k]] + known)
        run.nodes.append(len(parents))
        run.accepted.append(len(path))
        k += len(path) + 1
    run.tokens = answer[:max_new_tokens]
    return run


def answer_draft(prompt: Sequence[int], answer: Sequence[int], parents: Sequence[int], right: Sequence[bool],
                 vocab_size: int) -> Callable:
    """A draft that knows the greedy ``answer`` to ``prompt`` (for tests and demonstrations): at every
    step the tree ``parents``, node ``i`` holding the answer's token at its depth where ``right[i]``,
    a different token (``(that + 1 + i) % vocab_size``) where not. For a context that is not
    ``prompt + answer[:k]`` (a loop that went wrong) it proposes nothing, an empty tree; ``answer``
    must be long enough for the deepest node."""
    parents = check_tree(parents)
    prompt, answer, right = [int(t) for t in prompt], [int(t) for t in answer], [bool(r) for r in right]
    if len(right) != len(parents):
        raise ValueError(f"right needs one entry per node: {len(parents)} nodes, {len(right)} entries")
    depth = tree_depths(parents)

    def draft(context):
        context = [int(t) for t in context]
        k = len(context) - len(prompt)
        if k < 0 or context != prompt + answer[:k]:
            return [], []              # the context has left the answer (a wrong step): nothing to propose
        if k + max(depth, default=-1) >= len(answer):
            raise ValueError(f"answer_draft: the answer ({len(answer)} tokens) is too short for a tree at token {k}")
        good = [answer[k + d] for d in depth]
        return list(parents), [g if r else (g + 1 + i) % vocab_size for i, (g, r) in enumerate(zip(good, right))]

    return draft


class PassCounter:
    """``with PassCounter(model) as passes: ...`` counts the forward passes of ``model`` made inside
    (``passes.count``), as calls of its first block: whichever way the model is called."""

    def __init__(self, model):
        self.model, self.count, self._hook = model, 0, None

    def _seen(self, *_):
        self.count += 1

    def __enter__(self) -> PassCounter:
        self._hook = self.model.layers[0].register_forward_pre_hook(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
