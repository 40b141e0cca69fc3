"""Personalization in fedmq's loop: each client keeps a model of its own in its client state.

    fedper (Arivazhagan et al. 2019, "Federated Learning with Personalization Layers")
        before:  the global model, with the client's own layers (`layers`) from its state
        train:   all of it, as usual
        after:   its own layers into its state; the round's global values back into them, so the
                 update carries nothing of them (and the fold keeps the server's: rounds.fold)
    ditto (Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through Personalization")
        train:   the global model, as usual: the update is FedAvg's, bit for bit
        after:   the client's personal model v (its state; the round's global model the first time)
                 trained as many epochs on lossₖ(v) + lam/2·||v − w||², w the round's global model
                 (fedmq's proximal term), with plain SGD at train.lr and a batch order of its own;
                 v into its state

State keys: `personal.<parameter>` (fedper) and `ditto.<state_dict name>` (ditto), beside the
loop's `optimizer.*`. A client's personal model (`personal_model`) is what it is evaluated with,
next to the global model, as the `personal` metric source.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedmq.common.seeding import torch_generator
from fedmq.common.strategy.contract import PROXIMAL_MU
from fedmq.common.task.contexts import Personal, TrainContext
from fedmq.common.task.layers import own_layers
from fedmq.common.task.loop import train_with_loss

if TYPE_CHECKING:
    from fedmq.common.task.contract import Task

FEDPER, DITTO = "personal.", "ditto."


def before_training(model: nn.Module, ctx: TrainContext) -> None:
    """fedper: the client's own layers, from its state, into the global model it trains."""
    personal = ctx.train.personal
    if personal is None or personal.method != "fedper":
        return
    _load_own(model, ctx.state, personal)


def after_training(task: Task, model: nn.Module, data: Any, ctx: TrainContext) -> None:
    """fedper: its own layers kept, the global values sent; ditto: its personal model trained and kept."""
    personal = ctx.train.personal
    if personal is None:
        return
    if personal.method == "fedper":
        state = model.state_dict()
        with torch.no_grad():
            for name in own_layers(model, personal):
                ctx.state[FEDPER + name] = state[name].to("cpu", copy=True)
                state[name].copy_(ctx.global_weights[name])  # the update carries the round's values
        return
    mine = copy.deepcopy(model)
    kept = {k[len(DITTO):]: v for k, v in ctx.state.items() if k.startswith(DITTO)}
    mine.load_state_dict(kept or dict(ctx.global_weights))
    settings = dataclasses.replace(ctx.train, optimizer="sgd", momentum=0.0, weight_decay=0.0, dp_sgd=None,
                                   keep_optimizer_state=False, personal=None)
    own = dataclasses.replace(
        ctx, train=settings, config={PROXIMAL_MU: personal.lam}, client_state={}, private_seed=None, state={},
        generator=torch_generator(ctx.seed, "personal", ctx.round, ctx.client))
    train_with_loss(task, mine, data, own)
    for name, value in mine.state_dict().items():
        ctx.state[DITTO + name] = value.detach().to("cpu", copy=True)


def personal_model(model: nn.Module, state: Mapping[str, Any], personal: Personal) -> bool:
    """`model`, holding the global weights, made the client's personal model from its kept state;
    False (the model unchanged) for a client that has none yet: it never trained."""
    prefix = FEDPER if personal.method == "fedper" else DITTO
    if not any(k.startswith(prefix) for k in state):
        return False
    if personal.method == "fedper":
        _load_own(model, state, personal)
    else:
        model.load_state_dict({k[len(DITTO):]: v for k, v in state.items() if k.startswith(DITTO)})
    return True


def _load_own(model: nn.Module, state: Mapping[str, Any], personal: Personal) -> None:
    own = model.state_dict()
    with torch.no_grad():
        for name in own_layers(model, personal):
            if (kept := state.get(FEDPER + name)) is not None:
                own[name].copy_(kept)
