"""A complete custom Task with its own training loop: start here to bring your own workload.

Name it from a job spec (run from the repository root, or put your package on PYTHONPATH):

    task:
      name: "examples.plugins.my_task:MyTask"
      options: {num_classes: 3, width: 32}
    clients: {total: 4}
    rounds: 5
    train: {epochs: 1, batch_size: 32, lr: 0.1, options: {label_smoothing: 0.1}}

or from Python, with the class itself: `fedmq.Job(name="blobs", task=MyTask, ...)`.

A Task answers four questions, each in one method: what model (`build_model`), which data a
client holds (`load_data`), how one client trains for one round (`train`), and how good a model
is (`evaluate`). This one writes its own `train` (level 1: any code). A Task that only needs
"minimise this loss over batches" writes `loss(model, batch)` instead and lets fedmq run the
loop (level 2: see examples/regression.py); fedmq can then batch clients, clip and compress
for it.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

import fedmq


class MyOptions(BaseModel):
    """The spec's `task.options`, validated: a typo or a wrong type fails the job before it starts."""

    num_classes: int = Field(3, ge=2)
    num_features: int = Field(2, gt=0)
    samples_per_client: int = Field(150, gt=0)
    width: int = Field(32, gt=0)


class MyTask(fedmq.Task):
    """Gaussian blobs, one per class; every client draws its own sample of them."""

    Options = MyOptions
    options: MyOptions  # fedmq builds MyTask(**task.options) and validates them into this

    def build_model(self) -> nn.Module:
        # fedmq seeds torch around this call: every process builds the same initial weights.
        return nn.Sequential(
            nn.Linear(self.options.num_features, self.options.width),
            nn.Tanh(),
            nn.Linear(self.options.width, self.options.num_classes),
        )

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        # Called only on the learner serving this client. Randomness comes from the context
        # (`ctx.rng(...)` is seeded by the job's seed and the keys), so any process that loads
        # client 3 gets the same rows. Files that exist only on this machine: `ctx.data_dir`.
        x, y = _blobs(self._centres(ctx), self.options.samples_per_client, ctx.rng("client", ctx.client))
        n_val = len(y) // 5
        return fedmq.ClientData(train=(x[n_val:], y[n_val:]), val=(x[:n_val], y[:n_val]))

    def load_server_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        # Optional: data the aggregator scores every global model on (here: a fresh sample).
        return _blobs(self._centres(ctx), 300, ctx.rng("server"))

    def train(
        self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], ctx: fedmq.TrainContext
    ) -> fedmq.TrainResult:
        # Train `model` in place (it arrives on ctx.device holding this round's global weights)
        # and say how many examples it saw: FedAvg weights this client by that number.
        x, y = (t.to(ctx.device) for t in data)
        smoothing = float(ctx.train.options.get("label_smoothing", 0.0))  # the spec's train.options
        optimizer = torch.optim.SGD(model.parameters(), lr=ctx.train.lr, momentum=ctx.train.momentum)
        model.train()
        seen, loss_sum = 0, 0.0
        for _ in range(ctx.train.epochs):
            # Shuffle with ctx.generator (seeded by job, round and client), never global state.
            for idx in torch.randperm(len(y), generator=ctx.generator).split(ctx.train.batch_size):
                idx = idx.to(ctx.device)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx], label_smoothing=smoothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                seen += len(idx)
                loss_sum += float(loss.detach()) * len(idx)
        # Metrics: any names, plain floats; combined over clients by example-weighted mean
        # unless `metric_reduction` says otherwise.
        return fedmq.TrainResult(num_examples=seen, metrics={"loss": loss_sum / max(seen, 1)})

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], ctx: fedmq.EvalContext
    ) -> dict[str, float]:
        # Scores a global model: on the server's data (ctx.client is None) or on a client's
        # `val` (federated evaluation). The example count is len(data) unless you return
        # fedmq.EvalResult(num_examples, metrics).
        model.eval()
        x, y = (t.to(ctx.device) for t in data)
        logits = model(x)
        return {
            "loss": float(nn.functional.cross_entropy(logits, y)),
            "accuracy": float((logits.argmax(dim=1) == y).float().mean()),
        }

    def _centres(self, ctx: fedmq.DataContext) -> np.ndarray:
        """The class centres: drawn from the job's seed alone, so every client shares them."""
        shape = (self.options.num_classes, self.options.num_features)
        return ctx.rng("centres").normal(0.0, 3.0, size=shape)


def _blobs(centres: np.ndarray, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n points, labels cycling over the classes, each at its class's centre plus unit noise."""
    y = np.arange(n) % len(centres)
    x = centres[y] + rng.normal(0.0, 1.0, size=(n, centres.shape[1]))
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
