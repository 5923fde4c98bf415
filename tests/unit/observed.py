"""Observed children shared by the operator's status tests."""

from __future__ import annotations

from kvferry_operator.status import RoleObserved

# A role whose StatefulSet has rolled out and whose one replica is ready.
SETTLED = RoleObserved(
    exists=True,
    observed_generation=2,
    generation=2,
    replicas=1,
    ready_replicas=1,
    updated_replicas=1,
    current_revision="r1",
    update_revision="r1",
)
