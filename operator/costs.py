"""What a pull, a recompute and a prefill on decode alone cost this server, as
KVCacheStatus shows them (``status.costs``), and where its turns were prefilled
(``status.placement``). Pure.

Each decode sidecar times its turns' legs into least-squares sums
(``kvferry_wire.costfit``); sums add, so the server's fit is the fit of every leg
its decode pods timed. The tuner reads the prefill legs' fit for the recompute
threshold (``tune.recommend_threshold``); the decode sidecars choose where each
turn's prefill runs from their own fits (``kvferry_sidecar.placement``), which the
server's shows on average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvferry_wire import costfit
from kvferry_wire.protocol import ROLE_DECODE
from kvferry_wire.report import Placements, Report

PREFILL_NEEDS = (costfit.PULL, costfit.PULLED_TOKENS, costfit.COMPUTED_TOKENS)
DECODE_NEEDS = (costfit.ALONE, costfit.ALONE_COMPUTED_TOKENS, costfit.FETCHED_TOKENS)


def merged(fresh: Sequence[Report]) -> tuple[costfit.LinearFit, costfit.LinearFit]:
    """The server's prefill-leg and decode-leg fits (the decode pods' sums added: the
    decode sidecars time the turns; a prefill pod's sums are none of the server's)."""
    decode = [r for r in fresh if r.role == ROLE_DECODE]
    return (
        costfit.merge([r.costs.prefill_leg for r in decode], costfit.PREFILL_LEG),
        costfit.merge([r.costs.decode_leg for r in decode], costfit.DECODE_LEG),
    )


def _seen(fit: costfit.LinearFit, shape: costfit.Shape, name: str) -> int:
    return fit.nonzero[shape.features.index(name)]


def _r(value: float) -> float:
    """Four significant digits: a per-token cost of a fast link is 1e-7 s."""
    return float(f"{value:.4g}")


def status(prefill: costfit.LinearFit, decode: costfit.LinearFit) -> dict[str, Any]:
    """``status.costs``: each fit's legs and, once it can say, its costs (seconds);
    else why not yet."""
    out: dict[str, Any] = {
        "prefillLegs": prefill.observations,
        "pullLegs": _seen(prefill, costfit.PREFILL_LEG, costfit.PULL),
        "decodeLegs": decode.observations,
        "decodeAloneLegs": _seen(decode, costfit.DECODE_LEG, costfit.ALONE),
    }
    p = costfit.solve(prefill, costfit.PREFILL_LEG, PREFILL_NEEDS)
    if isinstance(p, costfit.Solved):
        c = p.coefficients
        out.update(
            prefillFixedSeconds=_r(c[costfit.ONE]),
            pullFixedSeconds=_r(c[costfit.PULL]),
            pullSecondsPerToken=_r(c[costfit.PULLED_TOKENS]),
            recomputeSecondsPerToken=_r(c[costfit.COMPUTED_TOKENS]),
            prefillRmsSeconds=_r(p.rms_seconds),
        )
    else:
        out["prefillReason"] = p.reason
    d = costfit.solve(decode, costfit.DECODE_LEG, DECODE_NEEDS)
    if isinstance(d, costfit.Solved):
        c = d.coefficients
        out.update(
            decodeFixedSeconds=_r(c[costfit.ONE]),
            decodeAloneFixedSeconds=_r(c[costfit.ALONE]),
            decodeAloneSecondsPerToken=_r(c[costfit.ALONE_COMPUTED_TOKENS]),
            decodeFetchSecondsPerToken=_r(c[costfit.FETCHED_TOKENS]),
            decodeOutputSecondsPerToken=_r(c[costfit.OUTPUT_TOKENS]),
            decodeRmsSeconds=_r(d.rms_seconds),
        )
    else:
        out["decodeReason"] = d.reason
    return out


def placement_status(fresh: Sequence[Report]) -> dict[str, Any]:
    """``status.placement``: turns prefilled by P and by decode alone, by what chose."""
    total = Placements()
    for rep in (r for r in fresh if r.role == ROLE_DECODE):
        for field in msgspec.structs.fields(Placements):
            setattr(
                total, field.name, getattr(total, field.name) + getattr(rep.placements, field.name)
            )
    return {
        "prefill": {
            "byCosts": total.prefill_by_costs,
            "byColdRule": total.prefill_by_cold_rule,
            "byRule": total.prefill_by_rule,
        },
        "decodeAlone": {
            "byCosts": total.decode_by_costs,
            "byColdRule": total.decode_by_cold_rule,
            "byRule": total.decode_by_rule,
        },
    }
