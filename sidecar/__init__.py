"""kvferry_sidecar: the program next to vLLM in every prefill and decode pod.

Owns the bidirectional turn protocol (decode pods: the OpenAI entry point, handles,
alignment, prefill routing), the residency model and its report, the KV-event
subscriber and the engine probes. ``README.md`` in this folder is the map.

May import ``kvferry_wire`` (the contract with the operator and clients); never
``kvferry_operator`` nor the dev harness ``kvferry_dev``
(``tests/static/test_layering.py`` checks it).
"""
