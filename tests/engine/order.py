"""The order the engine tier runs its modules in (tests/engine/conftest.py applies it)."""

from __future__ import annotations


def run_order(modules: list[tuple[str, set[str]]]) -> list[str]:
    """The engine tier's modules in the order that keeps the fewest engines up at once,
    from each module's fixture names (all its tests', transitively): first those that
    start their own engines and not the tier's pair (the demo, the slow link), so they
    have the cores to themselves; then the pair's; last those that also need the control
    plane and operator, which are package-scoped too and would otherwise keep running
    (and polling) through every module after the first that asked for them. Stable:
    collection order within each group.

    Why it matters: on 2 cores, a second pair beside the tier's (each engine pinned to
    a core, D's engine loop spinning while it holds a handle) slowed both."""

    def group(fixtures: set[str]) -> int:
        if "kubeconfig" in fixtures:
            return 2
        return 1 if "engine_pair" in fixtures else 0

    return [name for name, _ in sorted(modules, key=lambda m: group(m[1]))]
