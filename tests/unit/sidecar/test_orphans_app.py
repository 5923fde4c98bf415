"""A decode sidecar that restarts releases what its predecessor held (the pin journal
on the pod's emptyDir), and the report counts it as orphaned until D freed it."""

from __future__ import annotations

from pathlib import Path

from kvferry_sidecar.release import ledger_key

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_retention_app import released_params, residency
from .test_turns import LONG_QUESTION, Conversation, outcome, releases_done, rider


def journal_keys(client: object) -> set[str]:
    sc = sidecar_of(client)  # type: ignore[arg-type]
    assert sc.journal is not None
    return set(sc.journal.live)


async def test_the_journal_holds_what_d_pins_and_drops_what_d_freed(
    make_sidecar: MakeSidecar, engines: Engines, tmp_path: Path
) -> None:
    """Each turn's handle is noted; the next turn's pull frees it (gone); a handle
    dropped unread is gone once its release landed."""
    client = await make_sidecar(pin_journal_path=str(tmp_path / "pins.jsonl"))
    sc = sidecar_of(client)
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    first = {ledger_key(h) for h in sc.store.values()}
    assert len(first) == 1 and journal_keys(client) == first
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    await releases_done(client)
    second = {ledger_key(h) for h in sc.store.values()}
    assert len(second) == 1 and second != first
    assert journal_keys(client) == second
    # Another session's turn supersedes nothing; its handle released unread (the
    # store's cap of 1) is gone from the journal once P took the release.
    other = await make_sidecar(pin_journal_path=str(tmp_path / "b.jsonl"), handle_store_cap=1)
    a, b = Conversation(other, session_id="a"), Conversation(other, session_id="b")
    await a.ask(LONG_QUESTION)
    await b.ask(LONG_QUESTION)  # evicts a's handle: released through P
    await releases_done(other)
    assert journal_keys(other) == {ledger_key(h) for h in sidecar_of(other).store.values()}


async def test_a_restarted_sidecar_releases_what_its_predecessor_held(
    make_sidecar: MakeSidecar, engines: Engines, tmp_path: Path
) -> None:
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path))
    await Conversation(first, session_id="s").ask(LONG_QUESTION)
    (held,) = sidecar_of(first).store.values()
    # The process dies: the journal is as it was (a clean stop would release it).
    left = path.read_bytes()
    await first.close()
    path.write_bytes(left)
    before = len(released_params(engines))

    # The next process, its release held back so that the orphan is seen pinned.
    second = await make_sidecar(pin_journal_path=str(path), release_after_seconds=3600.0)
    rep = await residency(second)
    assert (rep.orphans.found, rep.orphans.found_blocks, rep.orphans.released) == (
        1,
        held.blocks,
        0,
    )
    assert (rep.pinned.orphaned_handles, rep.pinned.orphaned_blocks) == (1, held.blocks)
    assert rep.pinned.unused_handles == 1
    sc = sidecar_of(second)
    await sc.releaser.release_all([], timeout_s=5)  # what waits goes now
    assert released_params(engines)[before:] == [rider(dict(held.params))]
    rep = await residency(second)
    assert rep.orphans.released == 1 and rep.pinned.orphaned_handles == 0
    assert rep.releases.request >= 1
    assert journal_keys(second) == set()
    metrics = (await (await second.get("/metrics")).text()).splitlines()
    assert "kvferry_orphaned_handles_found_total 1.0" in metrics


async def test_what_a_restarted_d_freed_is_not_released(
    make_sidecar: MakeSidecar, engines: Engines, tmp_path: Path
) -> None:
    """D restarted while the sidecar was down: its pins went with it (void)."""
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path))
    await Conversation(first, session_id="s").ask(LONG_QUESTION)
    left = path.read_bytes()
    await first.close()
    path.write_bytes(left)
    engines.decode.started_at += 60
    before = len(released_params(engines))
    second = await make_sidecar(pin_journal_path=str(path))
    await releases_done(second)
    rep = await residency(second)
    assert (rep.orphans.found, rep.orphans.void, rep.pinned.orphaned_handles) == (0, 1, 0)
    assert len(released_params(engines)) == before


async def test_an_orphan_no_prefill_engine_can_release_counts_as_unreleasable(
    make_sidecar: MakeSidecar, engines: Engines, tmp_path: Path
) -> None:
    """No P to release it through: pinned until D's deadline, and said so."""
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path))
    await Conversation(first, session_id="s").ask(LONG_QUESTION)
    left = path.read_bytes()
    await first.close()
    path.write_bytes(left)
    second = await make_sidecar(pin_journal_path=str(path), prefill_engines=())
    await releases_done(second)
    rep = await residency(second)
    assert rep.orphans.found == 1 and rep.orphans.released == 0
    assert (rep.pinned.orphaned_handles, rep.pinned.unreleasable_handles) == (1, 1)
    assert rep.releases.unreleasable == 1
    metrics = (await (await second.get("/metrics")).text()).splitlines()
    assert "kvferry_pinned_unreleasable_handles 1.0" in metrics
