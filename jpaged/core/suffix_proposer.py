"""Suffix decoding proposals for speculative decoding: plain host logic, no jax.

Arctic Inference's SuffixDecoding (vLLM's `suffix` method, the same field names). Agentic and
self-refining workloads repeat themselves within a request (the output copies its prompt or its
own earlier output) and across requests (responses resemble earlier responses). Each request
keeps a suffix trie over its prompt + output, and the proposer keeps one more over the outputs
of up to `suffix_decoding_max_cached_requests` finished requests (the global trie). Every token
path of at most `suffix_decoding_max_tree_depth` (D) tokens that occurred is in the trie, with
the number of times it occurred in the tokens the trie covers. A path that occurred more than
once is a node with its children by next token; a path that occurred once, with every path below
it (one chain), is a tail: a reference to its one occurrence in the token list it came from,
which a request's growing tokens extend by themselves. A tail becomes a node when its path occurs
again (Arctic's compressed suffix tree, simplified), so a trie holds O(its tokens) objects, not
O(tokens * D).

To propose, each suffix of the request's tokens of length L (1 <= L < D) that is a path with a
next token in a trie (a match with a continuation) is extended greedily: follow the most
frequent next token (ties: the smallest token id) while the path's running probability, the
product of count(child) / count(node) along it, stays >= `suffix_decoding_min_token_prob`. The
draft with the highest score (the sum of those running probabilities: the expected number of
accepted tokens) wins; ties go to the longer match, then to the local trie. Every match length
is tried, as Arctic does, not only the deepest: a match of L tokens leaves at most D - L tokens
below it, so in a long copied span the deepest match (L = D - 1) could propose one token where a
shorter one proposes the whole budget. Proposal lengths are pruned by their bound, so the search
stops as soon as no shorter match can beat the best score.

In the request's own trie every suffix of its tokens matches itself (its one occurrence at the
very end, followed by nothing). That trivial self-match is never counted: a local path's count
is taken less that occurrence, which (below depth D) is the sum of its children's counts, so a
local match stands for earlier occurrences with a continuation only (the local matches are the
suffixes that are nodes: those that occurred before). In the global trie a
response that ended after a path does count in that path's count (it is a real "nothing
followed" outcome).

Invariants: a proposal is never longer than `num_speculative_tokens`, nor than `max_new` (what
the request may still add), nor than floor(`suffix_decoding_max_spec_factor` * L), nor than
D - L; every proposed token's running probability is >= `suffix_decoding_min_token_prob`; the
match followed by the proposal occurred contiguously in the request's tokens (starting before
the trivial self-match) or in one cached response; without a match that has a continuation,
nothing is proposed. A path's count is the number of its occurrences in the tokens its trie
covers (the global trie: the sum over the cached responses, prompts never included); evicting the
oldest cached response (FIFO beyond the limit) subtracts exactly its occurrences and drops the
paths that reach zero, so the global trie always holds the paths and counts of one built from
the remaining responses only.

Costs: `extend` is O(D) per new token (a count, a new tail or a split per suffix ending at the
token that occurred before, from the nodes of the suffixes that ended at the previous token; the
suffixes that did not are inside tails and cost nothing); `start_request` and caching or
evicting a response are O(D) per token; `propose` is O(D log D) trie steps to find the global
matches plus at most D - 1 drafts per trie of at most `num_speculative_tokens` steps (a scan of
one node's children, or a slice of a tail), far fewer after pruning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Absorbs float error in floor(max_spec_factor * match_len) (0.29 * 100 is 28.999...).
_FACTOR_EPS = 1e-9


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's `suffix` speculative method's fields."""

    num_speculative_tokens: int
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1, got "
                             f"{self.suffix_decoding_max_tree_depth}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0, got "
                             f"{self.suffix_decoding_max_cached_requests}")
        if not self.suffix_decoding_max_spec_factor > 0:  # NaN refused too
            raise ValueError("suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob}")


@dataclass(frozen=True)
class SuffixDraft:
    """One proposal with where it came from: `source` is 'local', 'global' or '' (none)."""

    tokens: tuple[int, ...]
    match_len: int
    score: float
    source: str


_NO_DRAFT = SuffixDraft((), 0, 0.0, "")


class _Node:
    """A path of a suffix trie that occurred more than once (or did, before an eviction): how
    often, and its children by next token."""

    __slots__ = ("count", "children")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Tail] | None = None


class _Tail:
    """A child path that occurred once, with every path below it: a reference to its one
    occurrence, `seq[pos]` its last token, so its chain of descendants is `seq[pos + 1:]` (cut
    at the tree depth and at the end of `seq`, a request's tokens grow in place)."""

    __slots__ = ("seq", "pos")
    count = 1

    def __init__(self, seq: list[int], pos: int) -> None:
        self.seq = seq
        self.pos = pos


def _advance(root: _Node, ends: list[_Node], seq: list[int], i: int,
             depth: int) -> list[_Node]:
    """Counts every path ending at `seq[i]` once. `ends` are the nodes (not tails) of the
    suffixes of 1, 2, .. tokens ending at `seq[i - 1]`: the longer ones, each one occurrence,
    are inside tails that `seq` extends by itself. The same list for `seq[i]` is returned."""
    t = seq[i]
    new: list[_Node] = []
    d = 0  # the depth of the path counted (the parent's + 1)
    for parent in (root, *ends[:depth - 1]):
        d += 1
        children = parent.children
        if children is None:
            children = parent.children = {}
        child = children.get(t)
        if child is None:  # then no longer suffix went on with t either
            children[t] = _Tail(seq, i)
        elif type(child) is _Tail:  # a second occurrence: the path becomes a node
            node = _Node(2)
            nxt = child.pos + 1  # the first occurrence's next token (at most i: it is earlier)
            if d < depth and nxt < len(child.seq):
                node.children = {child.seq[nxt]: _Tail(child.seq, nxt)}
            children[t] = node
            new.append(node)
        else:
            child.count += 1
            new.append(child)
    return new


def _insert(root: _Node, seq: list[int], depth: int) -> None:
    """Counts every path of at most `depth` tokens occurring in `seq` (tails then refer into
    `seq`: it must not change)."""
    ends: list[_Node] = []
    for i in range(len(seq)):
        ends = _advance(root, ends, seq, i, depth)


def _remove(root: _Node, seq: list[int], depth: int) -> None:
    """Undoes `_insert(root, seq, depth)`, dropping the paths whose count reaches zero."""
    ends: list[_Node] = []
    for t in seq:
        new: list[_Node] = []
        for parent in (root, *ends[:depth - 1]):
            # A dropped parent still holds its children, so the walk goes on through it.
            children = parent.children
            assert children is not None, "removing a response the trie never counted"
            child = children[t]
            if type(child) is _Tail:  # its one occurrence is this one, chain and all
                del children[t]
            else:
                child.count -= 1
                if child.count == 0:
                    del children[t]
                new.append(child)
        ends = new


def _path_counts(root: _Node, depth: int) -> dict[tuple[int, ...], int]:
    """{path: count} for every path of a trie, tails' chains unfolded."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], _Node]] = [((), root)]
    while stack:
        path, node = stack.pop()
        for tok, child in (node.children or {}).items():
            if type(child) is _Tail:
                seq, pos = child.seq, child.pos
                for j in range(min(depth - len(path), len(seq) - pos)):
                    out[path + tuple(seq[pos:pos + j + 1])] = 1
            else:
                out[path + (tok,)] = child.count
                stack.append((path + (tok,), child))
    return out


class _Request:
    """One request's tokens (prompt + output), its trie, and its suffixes' nodes in it."""

    __slots__ = ("tokens", "num_prompt", "root", "ends")

    def __init__(self, prompt: list[int], depth: int) -> None:
        self.tokens = prompt
        self.num_prompt = len(prompt)
        self.root = _Node(0)
        self.ends: list[_Node] = []
        for i in range(len(prompt)):
            self.ends = _advance(self.root, self.ends, prompt, i, depth)


class SuffixProposer:
    """Per-request suffix trees over prompt + output, plus a bounded global tree of earlier
    responses."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self._requests: dict[str, _Request] = {}
        self._global = _Node(0)
        self._cached: deque[list[int]] = deque()

    def _request(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise KeyError(f"unknown suffix-decoding request {req_id!r}") from None

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Builds the request's local tree from its prompt."""
        if req_id in self._requests:
            raise ValueError(f"suffix-decoding request {req_id!r} already started")
        self._requests[req_id] = _Request([int(t) for t in prompt_token_ids],
                                          self.config.suffix_decoding_max_tree_depth)

    def extend(self, req_id: str, new_token_ids: Sequence[int]) -> None:
        """Appends the request's newly accepted output tokens: O(max_tree_depth) per token."""
        req = self._request(req_id)
        depth = self.config.suffix_decoding_max_tree_depth
        root, ends, seq = req.root, req.ends, req.tokens
        for t in new_token_ids:
            seq.append(int(t))
            ends = _advance(root, ends, seq, len(seq) - 1, depth)
        req.ends = ends

    def propose(self, req_id: str, max_new: int | None = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_new) tokens; [] if nothing matches."""
        return list(self.propose_draft(req_id, max_new).tokens)

    def propose_draft(self, req_id: str, max_new: int | None = None) -> SuffixDraft:
        """`propose`'s draft with its match length, score and source (see the module doc)."""
        req = self._request(req_id)
        cfg = self.config
        cap = cfg.num_speculative_tokens if max_new is None else min(
            cfg.num_speculative_tokens, max_new)
        if cap <= 0 or not req.tokens:
            return _NO_DRAFT
        # The local matches are the suffixes that are nodes: those that occurred before.
        ends = req.ends
        best = self._search(lambda n: ends[n - 1], len(ends), cap, True, _NO_DRAFT)
        if self._global.children:
            tokens = req.tokens
            longest = self._longest_global_match(tokens)
            best = self._search(lambda n: self._global_at(tokens, n), longest, cap, False,
                                best)
        return best

    def stop_request(self, req_id: str, *, cache_response: bool = True) -> None:
        """Drops the request's local tree; with `cache_response`, counts its output tokens (not
        its prompt) in the global tree, evicting the oldest cached responses beyond
        `suffix_decoding_max_cached_requests`. An empty output caches nothing."""
        req = self._request(req_id)
        del self._requests[req_id]
        limit = self.config.suffix_decoding_max_cached_requests
        output = req.tokens[req.num_prompt:]
        if not cache_response or limit == 0 or not output:
            return
        depth = self.config.suffix_decoding_max_tree_depth
        _insert(self._global, output, depth)
        self._cached.append(output)
        while len(self._cached) > limit:
            _remove(self._global, self._cached.popleft(), depth)

    def clear_cache(self) -> None:
        """Forget every cached response: the global tree is empty again."""
        self._global = _Node(0)
        self._cached.clear()

    def num_active(self) -> int:
        """Requests started and not stopped."""
        return len(self._requests)

    def num_cached_responses(self) -> int:
        """Finished responses counted in the global tree."""
        return len(self._cached)

    def local_path_counts(self, req_id: str) -> dict[tuple[int, ...], int]:
        """{path: count} for every path of a request's tree (for tests and debugging)."""
        return _path_counts(self._request(req_id).root,
                            self.config.suffix_decoding_max_tree_depth)

    def global_path_counts(self) -> dict[tuple[int, ...], int]:
        """{path: count} for every path of the global tree (for tests and debugging)."""
        return _path_counts(self._global, self.config.suffix_decoding_max_tree_depth)

    def _global_at(self, tokens: list[int], n: int) -> _Node | _Tail | None:
        """Where the last `n` tokens end in the global tree: a node, a tail whose `pos` is the
        last one's (inside a tail's chain), or None where the path is absent."""
        node = self._global
        end = len(tokens)
        for k in range(end - n, end):
            children = node.children
            if not children:
                return None
            child = children.get(tokens[k])
            if child is None:
                return None
            if type(child) is _Tail:  # the rest must follow the one occurrence
                seq, pos = child.seq, child.pos
                rest = end - k - 1
                if seq[pos + 1:pos + 1 + rest] != tokens[k + 1:]:
                    return None
                return _Tail(seq, pos + rest)
            node = child
        return node

    def _longest_global_match(self, tokens: list[int]) -> int:
        """The most trailing tokens forming a global path with a child, at most D - 1 (the
        tree holds every suffix of its paths, so a binary search over lengths finds it)."""
        lo, hi = 0, min(len(tokens), self.config.suffix_decoding_max_tree_depth - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _goes_on(self._global_at(tokens, mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _search(self, node_at: Callable[[int], _Node | _Tail | None], longest: int, cap: int,
                local: bool, best: SuffixDraft) -> SuffixDraft:
        """The best of `best` and the drafts from matches of `longest` .. 1 tokens (`node_at`
        gives where a match ends, or None); a draft must beat `best`'s score strictly."""
        cfg = self.config
        depth = cfg.suffix_decoding_max_tree_depth
        factor = cfg.suffix_decoding_max_spec_factor
        for n in range(min(longest, depth - 1), 0, -1):
            # A draft scores at most its length; the factor's bound only falls with n.
            by_factor = min(cap, int(factor * n + _FACTOR_EPS))
            if by_factor <= best.score:
                break
            bound = min(by_factor, depth - n)
            if bound <= best.score:
                continue
            node = node_at(n)
            if not _goes_on(node):
                continue
            tokens, score = self._greedy(node, n, bound, local)
            if score > best.score:
                best = SuffixDraft(tuple(tokens), n, score, "local" if local else "global")
        return best

    def _greedy(self, node: _Node | _Tail, depth: int, limit: int,
                local: bool) -> tuple[list[int], float]:
        """Up to `limit` most frequent next tokens below `node` (at `depth`) while the running
        probability holds, and the sum of the running probabilities."""
        min_prob = self.config.suffix_decoding_min_token_prob
        max_depth = self.config.suffix_decoding_max_tree_depth
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if type(node) is _Tail:  # one occurrence: each next token has ratio 1 / 1
                pos = node.pos + 1
                for tok in node.seq[pos:pos + min(limit - len(out), max_depth - depth)]:
                    out.append(tok)
                    score += prob
                break
            children = node.children
            if not children:
                break
            best_tok, best_node, total = -1, None, 0
            for tok, child in children.items():
                c = child.count
                total += c
                if best_node is None or c > best_node.count or (
                        c == best_node.count and tok < best_tok):
                    best_tok, best_node = tok, child
            assert best_node is not None
            # Local: less the trivial self-match, which is what the children's counts sum to.
            prob *= best_node.count / (total if local else node.count)
            if prob < min_prob:
                break
            out.append(best_tok)
            score += prob
            node = best_node
            depth += 1
        return out, score


def _goes_on(node: _Node | _Tail | None) -> bool:
    """Whether a path (as `_global_at` finds it, or a node) has a next token in its tree."""
    if node is None:
        return False
    if type(node) is _Tail:
        return node.pos + 1 < len(node.seq)
    return bool(node.children)
