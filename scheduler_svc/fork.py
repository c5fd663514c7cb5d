"""n choices of one prompt (OpenAI's `n`, `best_of`): one prefill, the prompt's blocks shared.

The first choice (the leader) is an ordinary request. The others (followers) wait in the
waiting queue with `Request.fork_of` set, which admission skips, until the leader has
settled its prompt's full blocks on the device. Then each follower gets the leader's first
k = (prompt_len - 1) // block_size blocks in its own table (shared: the block manager's
reference counts, the ones prefix caching uses), starts RUNNING with k * block_size tokens
computed, computes the rest of the prompt itself (1 to block_size tokens) and samples
with its own seed stream.

Sharing only full blocks means no block is ever written by two requests, so there is no
copy on write: the one block the leader fills further (its last, partly full prompt
block) is recomputed by each follower instead of copied, at most block_size - 1 tokens.
A follower the leader cannot serve (the prompt is shorter than a block, or the leader
finishes or is gone before its blocks settle) is released to compute the prompt alone.
A rotation keeps the sharing (a rotated choice drops its references; a block another choice
still holds stays on the device); a recompute ends it for that choice.
"""

from __future__ import annotations

from scheduler_svc.request import Request

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads child seeds apart
_SEED_MOD = 1 << 63


def child_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: choice 0 keeps the request's own, the others get distinct
    streams that depend only on (seed, index), so a seeded request is reproducible."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _MIX) % _SEED_MOD


def child_id(request_id: str, index: int) -> str:
    """The scheduler's id of one choice ("#" never occurs in a gateway request id)."""
    return f"{request_id}#{index}"


def shared_blocks(leader: Request, block_size: int) -> int:
    """Blocks of the leader's prompt a follower can share: the full ones before the block
    holding the last prompt token (which the follower computes, to sample from)."""
    return (leader.num_prompt_tokens - 1) // block_size


class ForkGroups:
    """Followers by the leader they wait for."""

    def __init__(self) -> None:
        self._followers: dict[str, list[Request]] = {}

    def add(self, leader: Request, followers: list[Request]) -> None:
        for f in followers:
            f.fork_of = leader.request_id
        self._followers.setdefault(leader.request_id, []).extend(followers)

    def waiting_for(self, leader_id: str) -> bool:
        return leader_id in self._followers

    def pop(self, leader_id: str) -> list[Request]:
        """The leader's followers, no longer waiting for it."""
        out = self._followers.pop(leader_id, [])
        for f in out:
            f.fork_of = None
        return out

    def discard(self, follower: Request) -> None:
        """A follower that finished (aborted) before it forked."""
        if follower.fork_of is None:
            return
        group = self._followers.get(follower.fork_of, [])
        if follower in group:
            group.remove(follower)
        if not group:
            self._followers.pop(follower.fork_of, None)
        follower.fork_of = None

    def __len__(self) -> int:
        return sum(len(g) for g in self._followers.values())
