"""The step cache's forecast: a skipped step's answer extrapolated from the last computed steps.

TaylorSeer's idea (Liu et al., 2025: features forecast by a Taylor series whose derivatives are
finite differences of the last computed steps), written in the sampler's own time (the sigma or
timestep the model is called with) with Newton's divided differences, so uneven spacing (Karras
sigmas, a skip between two computed steps) is exact too: the polynomial through the last
`FORECAST_ORDER + 1` computed points (time, value), evaluated at the step's time. Order 1 needs two
points, order 2 three; with fewer, the order falls to what the points allow (one point: the value
itself, which is method reuse). Points at the same time count once (the newest).
"""
from __future__ import annotations

from typing import Sequence

import torch

FORECAST_ORDER = 2  # second order where three computed steps exist (TaylorSeer's best order at few steps)


def forecast(times: Sequence[float], values: Sequence[torch.Tensor], at: float, order: int = FORECAST_ORDER
             ) -> torch.Tensor:
    """The value at time `at` of the polynomial of degree <= `order` through the newest points
    (`times[i]`, `values[i]`), oldest first; its degree is one less than the distinct times used."""
    if len(times) != len(values) or not values:
        raise ValueError(f"forecast: {len(times)} times and {len(values)} values; use one time per value, at least one")
    if not 0 <= order <= 8:
        raise ValueError(f"forecast: order={order!r}; use 0 to 8")
    # newest first, one point per time, at most order + 1 of them
    points: list[tuple[float, torch.Tensor]] = []
    for t, v in zip(reversed(times), reversed(values)):
        if len(points) > order:
            break
        if all(t != seen for seen, _ in points):
            points.append((float(t), v))
    # Newton's form around the newest point: p(at) = f[t0] + f[t0,t1](at-t0) + f[t0,t1,t2](at-t0)(at-t1) + ...
    ts = [t for t, _ in points]
    column = [v.to(torch.promote_types(v.dtype, torch.float32)) for _, v in points]  # column k: differences of order k
    result = column[0].clone()
    weight = 1.0
    for k in range(1, len(points)):
        column = [(column[i] - column[i + 1]) / (ts[i] - ts[i + k]) for i in range(len(column) - 1)]
        weight *= at - ts[k - 1]
        result += weight * column[0]
    return result.to(values[-1].dtype)
