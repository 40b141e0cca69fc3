"""Whose layers are whose under personalization: the client's own (fedper's `layers`) and the
ones a proximal term pulls toward the global model.

Read by fedmq's loop (common/task/loop.py), personalization (common/task/personal.py), the
aggregator's fold and the CLI's checks; it imports neither the loop nor the Task.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from fedmq.common.task.contexts import Personal


def own_layers(model: nn.Module, personal: Personal) -> list[str]:
    """The tensors fedper keeps per client: the model's state (parameters and buffers, BatchNorm's
    statistics too) matching `layers`. ValueError when a pattern matches nothing, or the patterns
    match every parameter or none."""
    names = list(model.state_dict())
    params = {name for name, _ in model.named_parameters()}
    own = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in personal.layers)]
    idle = [p for p in personal.layers if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    shared = params - set(own)
    if idle or not shared or shared == params:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(
            f"personalize.layers {list(personal.layers)} match {len(params) - len(shared)} of the model's "
            f"{len(params)} parameters ({shown})"
            + (f"; {idle} match nothing" if idle else "") + ": name some, not all")
    return own


def proximal_names(model: nn.Module, personal: Personal | None) -> set[str]:
    """The parameters a proximal term (FedProx's mu) pulls toward the global model: under fedper, not
    the client's own layers (the server's never move)."""
    names = {name for name, _ in model.named_parameters()}
    if personal is None or personal.method != "fedper":
        return names
    return names - set(own_layers(model, personal))
