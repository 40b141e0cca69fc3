"""Robust aggregation: coordinate-wise median, trimmed mean, Krum and Multi-Krum, Bulyan, norm clipping.

These rules need all k updates of a round at once, so they read them tensor by
tensor from lazy mappings (a TensorFile reads one tensor per access) and, for a
large tensor, a slice of coordinates at a time::

    for each tensor name, for each slice of at most chunk_bytes // k coordinates:
        stack[k, slice] <- updates[0][name][slice], ..., updates[k-1][name][slice]
        out[name][slice] <- rule(stack)          (per coordinate, along the client axis)

Memory is the output (one model) plus one stack of at most chunk_bytes plus one
tensor being read. Median and trimmed mean select and sort the stack in place
(NumPy), so they add nothing; Bulyan's distances to the median add a few stacks.
A tensor split into n slices is read n times per client: the price of not holding
k copies.

Floating tensors are computed in float32 (float64 stays float64) and cast back.
Integer and bool tensors (batch counters) are never averaged: each coordinate takes
the lower median (the ceil(n/2)-th smallest) of the n values the rule keeps: all k for
the median and the trimmed mean (the same as the lower median after trimming), the m
selected for Krum (for m=1, the selected client's value), the theta selected for
Bulyan. Complex tensors are refused. Sums along the client axis are folded in client
order, so the same inputs give bit-identical outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from fedmq.common.errors import AggregationError

StateDict = dict[str, torch.Tensor]
Updates = Sequence[Mapping[str, torch.Tensor]]
Rule = Callable[[torch.Tensor], torch.Tensor]

CHUNK_BYTES = 64 * 1024 * 1024  # the client-by-coordinate stack a rule works on at one time
_LANES = 4096  # width of the fixed-order sums in pairwise_sq_distances


def coordinate_median(updates: Updates, *, chunk_bytes: int = CHUNK_BYTES) -> StateDict:
    """Per coordinate, the median of the k values; for even k the mean of the two middle values."""
    k = _check_count(updates, "coordinate_median")
    lower, upper = (k - 1) // 2, k // 2  # 0-based ranks of the middle value(s)

    def median(stack: torch.Tensor) -> torch.Tensor:
        _partition(stack, lower, upper)
        return stack[lower] if lower == upper else stack[lower].add(stack[upper]).div_(2)

    return _coordinatewise(updates, range(k), median, chunk_bytes)


def trimmed_mean(updates: Updates, beta: float, *, chunk_bytes: int = CHUNK_BYTES) -> StateDict:
    """Per coordinate, drop the floor(beta*k) largest and smallest values and average the rest."""
    k = _check_count(updates, "trimmed_mean")
    if not 0 <= beta < 0.5:
        raise AggregationError(
            f"trimmed_mean drops floor(beta*k) values from each end, so beta must be in [0, 0.5)"
            f" or nothing is left; got beta={beta}: lower beta"
        )
    cut = math.floor(beta * k)  # beta < 0.5 leaves k - 2*cut >= 1 values

    def trimmed(stack: torch.Tensor) -> torch.Tensor:
        stack.numpy().sort(axis=0, kind="stable")  # in place: no copy of the stack
        return _fold_mean(stack[cut : k - cut])

    return _coordinatewise(updates, range(k), trimmed, chunk_bytes)


def pairwise_sq_distances(updates: Updates, *, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """k x k float64 matrix of squared L2 distances between updates, over all floating tensors.

    Accumulated tensor by tensor (and slice by slice), each pair's sum taken in an
    order that depends on neither the thread count nor anything but the inputs.
    """
    k = _check_count(updates, "pairwise_sq_distances")
    distances = torch.zeros((k, k), dtype=torch.float64)
    for name, (dtype, shape) in _layout(updates).items():
        if not dtype.is_floating_point:
            continue
        for stack in _stacks(updates, range(k), name, shape.numel(), torch.float64, chunk_bytes):
            for i in range(k):
                for j in range(i + 1, k):
                    diff = stack[i] - stack[j]
                    distances[i, j] += _fixed_order_sum(diff.mul_(diff))
            del stack
    return distances + distances.T


def krum_select(distances: torch.Tensor, f: int, m: int = 1) -> list[int]:
    """Krum (Blanchard et al. 2017): the m clients with the lowest scores, best first.

    A client's score is the sum of its k-f-2 smallest squared distances to the
    others; Krum needs k > 2f+2. Equal scores go to the lower index.
    """
    k = _check_distances(distances)
    if f < 0:
        raise AggregationError(f"krum needs f >= 0, got f={f}")
    if k <= 2 * f + 2:
        raise AggregationError(
            f"krum with f={f} needs at least {2 * f + 3} clients, got {k}: lower f or select more clients"
        )
    if not 1 <= m <= k:
        raise AggregationError(f"krum selects m clients with 1 <= m <= {k} (the clients), got m={m}")
    scores = _krum_scores(distances, list(range(k)), k - f - 2)
    return sorted(range(k), key=lambda i: (scores[i], i))[:m]


def krum(
    updates: Updates,
    f: int,
    m: int = 1,
    weights: Sequence[float] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[StateDict, list[int]]:
    """Krum (m=1) or Multi-Krum (m>1): the (weighted) mean of the m best-scored updates, and who they are.

    Returns the aggregate and the selected indices, best first. Weights (e.g.
    example counts) weigh the mean of the selected updates; by default all are 1.
    """
    k = _check_count(updates, "krum")
    if weights is not None and len(weights) != k:
        raise AggregationError(f"krum got {len(weights)} weights for {k} updates")
    selected = krum_select(pairwise_sq_distances(updates, chunk_bytes=chunk_bytes), f, m)
    chosen = [1.0] * k if weights is None else [float(w) for w in weights]
    return _selected_mean(updates, sorted(selected), chosen), selected


def bulyan(updates: Updates, f: int, *, chunk_bytes: int = CHUNK_BYTES) -> tuple[StateDict, list[int]]:
    """Bulyan (El Mhamdi et al. 2018) over Krum; returns the aggregate and the theta selected, in order.

    Needs k >= 4f+3. Selects theta = k-2f updates by Krum applied again and again
    to those not yet selected (each time the best score among the remaining r,
    over its max(1, r-f-2) nearest remaining others; equal scores go to the lower
    index). Then per coordinate takes the beta = theta-2f selected values closest
    to their median (median as in coordinate_median; equal distances prefer the
    lower value) and averages them.
    """
    k = _check_count(updates, "bulyan")
    if f < 0:
        raise AggregationError(f"bulyan needs f >= 0, got f={f}")
    if k < 4 * f + 3:
        raise AggregationError(
            f"bulyan with f={f} needs at least {4 * f + 3} clients, got {k}: lower f or select more clients"
        )
    distances = pairwise_sq_distances(updates, chunk_bytes=chunk_bytes)
    theta, beta = k - 2 * f, k - 4 * f
    remaining, selected = list(range(k)), list[int]()
    while len(selected) < theta:
        closest = min(max(1, len(remaining) - f - 2), len(remaining) - 1)
        scores = _krum_scores(distances, remaining, closest)
        best = min(remaining, key=lambda i: (scores[i], i))
        selected.append(best)
        remaining.remove(best)
    lower, upper = (theta + 1) // 2 - 1, theta // 2  # 0-based positions of the middle value(s)

    def closest_to_median(stack: torch.Tensor) -> torch.Tensor:
        stack.numpy().sort(axis=0, kind="stable")  # in place; the distances below are copies
        median = (stack[lower] + stack[upper]) / 2
        nearest = (stack - median).abs_().sort(dim=0, stable=True).indices[:beta]
        return _fold_mean(stack.gather(0, nearest))

    return _coordinatewise(updates, sorted(selected), closest_to_median, chunk_bytes), selected


_CLIP_MARGIN = 1e-12  # relative: any summation order of the clipped norm stays under the bound


def clip_to_norm(update_delta: Mapping[str, torch.Tensor], max_norm: float) -> tuple[StateDict, float]:
    """Scale a delta so the global L2 norm of its floating tensors is at most max_norm.

    Returns the clipped delta and its norm before clipping. The norm is taken in
    float64 over all floating tensors together; other tensors are copied unchanged.
    After rounding to each tensor's dtype the clipped norm never exceeds max_norm, however it is
    summed: the check keeps a relative margin of 1e-12 (thousands of float64 ulps) below the bound,
    since another summation order can read the same norm a few ulps higher.
    """
    if not math.isfinite(max_norm) or max_norm <= 0:
        raise AggregationError(f"clip_to_norm needs a finite max_norm > 0, got {max_norm}")
    norm = _global_norm(update_delta)
    if not math.isfinite(norm):
        raise AggregationError(f"the update's norm is {norm}: it holds non-finite values")
    if norm <= max_norm:
        return {name: tensor.clone() for name, tensor in update_delta.items()}, norm
    scale = max_norm / norm
    # Rounding to a narrow dtype can land just above the bound: shrink by its epsilon until it does not.
    step = 1 - max(torch.finfo(t.dtype).eps for t in update_delta.values() if t.dtype.is_floating_point)
    while True:
        clipped = {
            name: tensor.to(torch.float64, copy=True).mul_(scale).to(tensor.dtype)
            if tensor.dtype.is_floating_point
            else tensor.clone()
            for name, tensor in update_delta.items()
        }
        if _global_norm(clipped) <= max_norm * (1 - _CLIP_MARGIN):
            return clipped, norm
        scale *= step


# -- the tensor-by-tensor machinery --------------------------------------------------------


def _coordinatewise(updates: Updates, indices: Sequence[int], rule: Rule, chunk_bytes: int) -> StateDict:
    """Apply a per-coordinate rule over the chosen updates, tensor by tensor and slice by slice."""
    out: StateDict = {}
    for name, (dtype, shape) in _layout(updates).items():
        floating = dtype.is_floating_point
        work = _work_dtype(dtype)
        result = torch.empty(shape.numel(), dtype=work)
        lower = (len(indices) - 1) // 2  # integer tensors: the lower median of the kept values
        start = 0
        for stack in _stacks(updates, indices, name, shape.numel(), work, chunk_bytes):
            stop = start + stack.shape[1]
            result[start:stop] = rule(stack) if floating else _partition(stack, lower, lower)[lower]
            start = stop
            del stack
        out[name] = result.reshape(shape).to(dtype)
    return out


def _selected_mean(updates: Updates, indices: Sequence[int], weights: Sequence[float]) -> StateDict:
    """Weighted mean of the chosen updates for floating tensors, lower median for the others."""
    total = math.fsum(weights[i] for i in indices)
    if any(w < 0 or not math.isfinite(w) for w in weights) or total <= 0:
        raise AggregationError(f"weights must be finite, non-negative and not all zero, got {list(weights)}")
    out: StateDict = {}
    for name, (dtype, _) in _layout(updates).items():
        if dtype.is_floating_point:
            acc = updates[indices[0]][name].to(_work_dtype(dtype), copy=True).mul_(weights[indices[0]])
            for i in indices[1:]:
                acc.add_(updates[i][name].to(acc.dtype), alpha=weights[i])
            out[name] = acc.div_(total).to(dtype)
        else:
            stack = torch.stack([updates[i][name].to(_work_dtype(dtype)) for i in indices])
            out[name] = stack.kthvalue((len(indices) + 1) // 2, dim=0).values.to(dtype)
    return out


def _stacks(
    updates: Updates, indices: Sequence[int], name: str, numel: int, work: torch.dtype, chunk_bytes: int
) -> Iterator[torch.Tensor]:
    """The (clients x coordinates) stacks of one tensor, a slice at a time; each slice reads the tensor again.

    The caller drops each stack before asking for the next, so only one is alive.
    """
    if chunk_bytes <= 0:
        raise AggregationError(f"chunk_bytes must be positive, got {chunk_bytes}")
    step = max(_LANES, chunk_bytes // (len(indices) * work.itemsize) // _LANES * _LANES)
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        stack = torch.empty((len(indices), stop - start), dtype=work)
        for row, i in enumerate(indices):
            stack[row] = updates[i][name].reshape(-1)[start:stop]  # the tensor read is freed at once
        yield stack
        del stack


def _layout(updates: Updates) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """Names, dtypes and shapes of the first update; every other update must match them."""
    layout = {name: _meta(updates[0], name) for name in updates[0]}
    for index, update in enumerate(updates[1:], start=1):
        if update.keys() != layout.keys():
            raise AggregationError(f"update {index} disagrees with update 0 on tensor names")
        for name, (dtype, shape) in layout.items():
            if _meta(update, name) != (dtype, shape):
                raise AggregationError(
                    f"{name}: update {index} has {_meta(update, name)}, update 0 has {(dtype, shape)}"
                )
            if dtype.is_complex:
                raise AggregationError(f"{name}: robust aggregation takes real tensors, got {dtype}")
    return layout


def _meta(update: Mapping[str, torch.Tensor], name: str) -> tuple[torch.dtype, torch.Size]:
    """dtype and shape without reading the tensor when the mapping is lazy (a TensorFile, a group's row)."""
    meta = getattr(update, "meta", None)
    if callable(meta):
        return meta(name)
    tensor = update[name]
    return tensor.dtype, tensor.shape


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64 or not dtype.is_floating_point:
        return torch.uint8 if dtype == torch.bool else dtype
    return torch.float32


def _partition(stack: torch.Tensor, *ranks: int) -> torch.Tensor:
    """Reorder each column in place so that row r holds its r-th smallest value for each given rank.

    NumPy's introselect: no copy of the stack (torch's kthvalue and median copy it and add int64 indices).
    """
    stack.numpy().partition(list(ranks), axis=0)
    return stack


def _fold_mean(rows: torch.Tensor) -> torch.Tensor:
    """Mean along the first axis, summed row after row in order (bit-reproducible)."""
    acc = rows[0].clone()
    for row in rows[1:]:
        acc.add_(row)
    return acc.div_(rows.shape[0])


def _fixed_order_sum(values: torch.Tensor) -> float:
    """Sum of a 1-d float64 tensor in an order fixed by its length alone, not by torch's threads."""
    whole = values.numel() - values.numel() % _LANES
    lanes = values[:whole].view(-1, _LANES).sum(dim=0)  # each lane summed down its rows, in order
    return float(lanes.sum()) + float(values[whole:].sum())  # both under torch's parallel grain


def _global_norm(state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of all floating tensors together, in float64."""
    total = 0.0
    for tensor in state.values():
        if tensor.dtype.is_floating_point:
            flat = tensor.reshape(-1).to(torch.float64, copy=True)
            total += _fixed_order_sum(flat.mul_(flat))
    return math.sqrt(total)


def _krum_scores(distances: torch.Tensor, among: Sequence[int], closest: int) -> dict[int, float]:
    """Each client's sum of its `closest` smallest squared distances to the others in `among`."""
    scores: dict[int, float] = {}
    for i in among:
        others = sorted(float(distances[i, j]) for j in among if j != i)
        scores[i] = math.fsum(others[:closest])
    return scores


def _check_count(updates: Updates, rule: str) -> int:
    if not updates:
        raise AggregationError(f"{rule} needs at least one update, got none")
    return len(updates)


def _check_distances(distances: torch.Tensor) -> int:
    if distances.dim() != 2 or distances.shape[0] != distances.shape[1] or distances.shape[0] == 0:
        shape = tuple(distances.shape)
        raise AggregationError(f"distances must be a non-empty k x k matrix, got shape {shape}")
    return int(distances.shape[0])
