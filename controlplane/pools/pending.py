"""Why a replica is not serving yet: placed and loading, or waiting for Ray resources (pure logic).

A replica's actor answers only once its model is loaded, so whether Ray has placed it is judged from
resources: it waits when some resource it needs is short both in what Ray reports free now and in what
the cluster holds beyond the replicas already serving and the older pending ones (Ray places pending
actors in the order they were asked for).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from controlplane.pools.status import PendingReplica

EPSILON = 1e-9  # Ray's resource amounts are fixed-point; compare with a little slack


def explain(starting: Sequence[tuple[str, float]], needs: Mapping[str, float], held: Mapping[str, float],
            total: Mapping[str, float], free: Mapping[str, float], now: float) -> tuple[PendingReplica, ...]:
    """``starting``: (actor name, time asked for) of one pool's pending replicas, any order. ``needs``: what
    one of them asks of Ray. ``held``: resources the serving replicas (all pools) hold. ``total`` / ``free``:
    the cluster's resources and what is free now (``ray.cluster_resources`` / ``available_resources``).
    Times in seconds of one clock. Returns the replicas oldest first, each with its reason."""
    held = dict(held)
    out = []
    for name, asked_at in sorted(starting, key=lambda s: s[1]):
        short = {k: v for k, v in needs.items()
                 if v > free.get(k, 0.0) + EPSILON and v > total.get(k, 0.0) - held.get(k, 0.0) + EPSILON}
        if short:
            reason = "waiting for Ray resources: " + "; ".join(
                f"needs {k} {v:g}, the cluster has {total.get(k, 0.0):g} ({free.get(k, 0.0):g} free)"
                for k, v in short.items())
        else:
            reason = "placed; loading the model"
        out.append(PendingReplica(name, round(max(0.0, now - asked_at), 1), dict(needs), not short, reason))
        for k, v in needs.items():  # the next pending one queues behind this one
            held[k] = held.get(k, 0.0) + v
    return tuple(out)
