"""Which blocks the local engine holds, and for which sessions, from its KV events.

Pure: ``kvsubscriber`` feeds it decoded batches (``kvevents``) with their sequence
numbers; ``BlockIndex.check`` tells the subscriber whether a batch is next, after a
gap, a duplicate of a replay, or from a restarted engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvferry_wire.report import KVEvents

from .kvevents import Batch, Cleared, Event, Removed, Stored

BlockKey = tuple[str | None, int, Hashable]  # (medium, group_idx, block hash)


@dataclass
class BlockInfo:
    session: str | None
    tokens: int


class Verdict:
    """What ``BlockIndex.check`` says about a batch's sequence number."""

    NEXT = "next"  # in order (or the first batch seen): apply it
    GAP = "gap"  # batches are missing before it: repair, then apply
    DUPLICATE = "duplicate"  # already applied (a replay overlapped the live stream)
    RESTART = "restart"  # the counter went back: the engine's publisher restarted


@dataclass
class BlockIndex:
    """Which blocks the local engine holds and for which sessions, from its events.

    Sequence rules: the first batch sets the baseline (history before it is not
    known); a jump forward is a gap (``missed``; ``repaired`` when the replay socket
    filled it); a batch below the next expected one is a duplicate when it lies in
    the range the last replay covered, else the engine restarted (state dropped).
    ``AllBlocksCleared`` drops the state too. Bounded: beyond ``cap`` blocks the
    oldest entries are forgotten.
    """

    cap: int = 2_000_000
    blocks: dict[BlockKey, BlockInfo] = field(default_factory=dict)
    session_blocks: dict[str, int] = field(default_factory=dict)
    next_seq: int | None = None
    batches: int = 0
    missed: int = 0
    repaired: int = 0
    cleared: int = 0
    _replayed_from: int | None = None
    # Storage tiers seen in events (GPU, CPU, ...): a prefix lookup tries each.
    _media: set[str | None] = field(default_factory=set)

    # -------------------------------------------------------------- sequence

    def check(self, seq: int) -> str:
        if self.next_seq is None or seq == self.next_seq:
            return Verdict.NEXT
        if seq > self.next_seq:
            return Verdict.GAP
        if self._replayed_from is not None and seq >= self._replayed_from:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def note_gap(self, start: int) -> None:
        """A gap from ``start`` was seen; a replay from there may follow."""
        self.missed += 1
        self._replayed_from = start

    def note_repaired(self) -> None:
        self.repaired += 1

    def caught_up(self) -> None:
        """A live batch followed the replay: no more duplicates can come (SUB is
        in order), so a lower sequence number from now on means a restart."""
        self._replayed_from = None

    def accept(self, seq: int, batch: Batch) -> None:
        """Apply ``batch`` as sequence number ``seq`` (the caller has checked it)."""
        for event in batch.events:
            self.apply(event)
        self.batches += 1
        self.next_seq = seq + 1

    def skip_to(self, seq: int) -> None:
        """Continue after an unrepaired gap: what was missed is unknown, so the
        state is dropped rather than left with blocks that may be long gone."""
        self._drop()
        self.next_seq = seq

    # -------------------------------------------------------------- events

    def apply(self, event: Event) -> None:
        if isinstance(event, Stored):
            per_block = event.block_size or (
                event.num_tokens // max(1, len(event.block_hashes)) if event.block_hashes else 0
            )
            for h in event.block_hashes:
                self._put((event.medium, event.group_idx, h), event.session_id, per_block)
        elif isinstance(event, Removed):
            for h in event.block_hashes:
                self._pop((event.medium, event.group_idx, h))
        elif isinstance(event, Cleared):
            self.reset()

    def reset(self) -> None:
        """AllBlocksCleared or an engine restart: nothing is held any more."""
        self._drop()
        self.cleared += 1

    def restart(self) -> None:
        """The engine restarted: its sequence starts again at 0."""
        self.reset()
        self.next_seq = None
        self._replayed_from = None

    def _drop(self) -> None:
        self.blocks.clear()
        self.session_blocks.clear()

    def _put(self, key: BlockKey, session: str | None, tokens: int) -> None:
        self._media.add(key[0])
        old = self.blocks.pop(key, None)
        if old is not None:
            self._unref(old.session)
        self.blocks[key] = BlockInfo(session, tokens)
        if session is not None:
            self.session_blocks[session] = self.session_blocks.get(session, 0) + 1
        while len(self.blocks) > self.cap:
            oldest = next(iter(self.blocks))
            self._pop(oldest)

    def _pop(self, key: BlockKey) -> None:
        info = self.blocks.pop(key, None)
        if info is not None:
            self._unref(info.session)

    def _unref(self, session: str | None) -> None:
        if session is None:
            return
        left = self.session_blocks.get(session, 0) - 1
        if left > 0:
            self.session_blocks[session] = left
        else:
            self.session_blocks.pop(session, None)

    # -------------------------------------------------------------- figures

    def held_by(self, session: str) -> int:
        return self.session_blocks.get(session, 0)

    def held_prefix(self, hashes: Sequence[Hashable]) -> int:
        """How many of ``hashes`` (a prompt's block hashes, first block first) the
        engine holds as an unbroken prefix: what its prefix cache would find."""
        held = 0
        for h in hashes:
            if not any((m, 0, h) in self.blocks for m in self._media):
                break
            held += 1
        return held

    def stats(self) -> KVEvents:
        return KVEvents(
            blocks_held=len(self.blocks),
            sessions_held=len(self.session_blocks),
            batches=self.batches,
            missed=self.missed,
            repaired=self.repaired,
            cleared=self.cleared,
        )
