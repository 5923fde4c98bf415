"""kvferry_wire: the contract between the operator, the sidecar and their clients.

Owns what both sides must agree on and nothing else:

- ``protocol``: ports in every engine pod, the roles (``ROLE_PREFILL``,
  ``ROLE_DECODE``, ``ROLES``), the HTTP headers and paths the sidecar
  speaks to clients and peers, the per-turn outcome and route values those headers
  carry, the report endpoint's path and token audience, and the handle-expiry
  margin the sidecar applies and the operator's tuner adds back.
- ``report``: the residency report (format version, fields, histogram buckets and
  the one ``Histogram`` type both sides compute with), its decoder and encoder.
- ``policy``: the live policy (retention, recompute threshold, skip-prefill) the
  operator sends each sidecar in its report answer, checked field by field.
- ``settings``: the sidecar's settings (``SidecarSettings``: fields and defaults) and
  the settings file the operator writes and the sidecar reads (``SettingsFile``).
- ``extras``: which extra of the one ``kvferry`` distribution each program needs
  (``operator``, ``sidecar``), read from the installed metadata, so a program started
  without it says which ``pip install`` fixes it.

May import: the standard library and msgspec. Never ``kvferry_operator``,
``kvferry_sidecar`` or ``kvferry_dev`` (``tests/static/test_layering.py`` checks it):
both runtime packages import this one, so it must not pull either into the other.
"""
