"""A GAN on handwritten digits (scikit-learn's 8x8 images): seed 002's first example.

The generator and the discriminator are two halves of ONE module, so one state dict carries
both and FedAvg averages each half with its own kind. The Task brings its own `train` (level 1):
each batch takes a discriminator step on real and generated images, then a generator step
(the non-saturating loss), each with its own Adam. The optimizers are made afresh every round
rather than carried as buffers in the model: FedAvg would average the clients' Adam moments as
if they were weights (a quantity with no shared meaning across clients), the state dict would
triple, and Adam's bias correction re-estimates the moments within a few steps anyway.

Sample quality, a fixed and documented measure (`sample_quality`), against real held-out digits
on the [0, 1] pixel scale, with `EVAL_SAMPLES` images generated from latents fixed by the seed
(the same latents every round, so rounds compare like with like):

    mmd          unbiased MMD² with a Gaussian kernel exp(-|a-b|² / 2σ²), σ = 3.0 (about the
                 median distance between two real digits); 0 when the two sets look alike
    nn_distance  mean distance from a generated image to its nearest held-out real image

Both are server metrics, so round 0 (the untrained generator) is measured too. At the end,
`write_samples(model, path)` draws an 8x8 grid of generated digits as a PNG; `Gan.export`, which
the aggregator calls after the last round, writes it as `artifacts/samples.png` in the job's folder.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import fedmq
from fedmq.data import IidPartition, partition, stratified_split

PIXELS = 64  # 8x8 images, flattened
SIGMA = 3.0  # the kernel's bandwidth, in [0, 1] pixel units
EVAL_SAMPLES = 360  # generated images per evaluation
BETAS = (0.5, 0.999)  # Adam's betas, as GANs usually train
REAL_LABEL = 0.9  # one-sided label smoothing: the discriminator never grows fully sure of real images


class GanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    latent: int = Field(16, gt=0)
    hidden: list[Annotated[int, Field(gt=0)]] = [128, 128]
    test_fraction: float = Field(0.2, gt=0, lt=1)


class Generator(nn.Sequential):
    """Latent vector → image in [-1, 1]."""


class Discriminator(nn.Sequential):
    """Image in [-1, 1] → one logit: real (> 0) or generated."""


class GanModel(nn.Module):
    """The two networks in one module: `generator.*` and `discriminator.*` in one state dict."""

    def __init__(self, latent: int, hidden: list[int]) -> None:
        super().__init__()
        self.latent = latent
        self.generator = Generator(*_mlp([latent, *hidden, PIXELS]), nn.Tanh())
        self.discriminator = Discriminator(*_mlp([PIXELS, *hidden[::-1], 1]))

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n generated images, (n, 64) in [0, 1], from latents drawn with `generator`."""
        z = torch.randn(n, self.latent, generator=generator)
        device = next(self.parameters()).device
        return (self.generator(z.to(device)) + 1) / 2


class Gan(fedmq.Task):
    """Generator and discriminator trained together on each client; metrics g_loss and d_loss."""

    Options = GanOptions
    objective = fedmq.Objective("server.mmd", "min")
    options: GanOptions

    def build_model(self) -> nn.Module:
        return GanModel(self.options.latent, self.options.hidden)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        x, train, test = _digits(self.options.test_fraction, ctx.seed)
        mine = train[_parts(self.options.test_fraction, ctx.seed, ctx.num_clients)[ctx.client]]
        val = np.array_split(test, ctx.num_clients)[ctx.client]
        return fedmq.ClientData(train=x[_index(mine)] * 2 - 1, val=x[_index(val)])  # train in [-1, 1]

    def load_server_data(self, ctx: fedmq.DataContext) -> torch.Tensor:
        x, _, test = _digits(self.options.test_fraction, ctx.seed)
        return x[_index(test)]

    def train(self, model: nn.Module, data: torch.Tensor, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        assert isinstance(model, GanModel)
        g, d = model.generator, model.discriminator
        opt_g = torch.optim.Adam(g.parameters(), lr=ctx.train.lr, betas=BETAS)
        opt_d = torch.optim.Adam(d.parameters(), lr=ctx.train.lr, betas=BETAS)
        bce = nn.functional.binary_cross_entropy_with_logits
        model.train()
        real_all = data.to(ctx.device)
        for _ in range(ctx.train.epochs):
            g_sum, d_sum, seen = 0.0, 0.0, 0
            for idx in torch.randperm(len(data), generator=ctx.generator).split(ctx.train.batch_size):
                real = real_all[idx.to(ctx.device)]
                z = torch.randn(len(idx), model.latent, generator=ctx.generator).to(ctx.device)
                fake = g(z)
                ones = torch.ones(len(idx), 1, device=ctx.device)
                zeros = torch.zeros(len(idx), 1, device=ctx.device)
                d_loss = bce(d(real), ones * REAL_LABEL) + bce(d(fake.detach()), zeros)
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()
                g_loss = bce(d(fake), ones)  # the non-saturating generator loss
                opt_g.zero_grad(set_to_none=True)
                g_loss.backward()
                opt_g.step()
                g_sum += float(g_loss.detach()) * len(idx)
                d_sum += float(d_loss.detach()) * len(idx)
                seen += len(idx)
        return fedmq.TrainResult(seen, {"g_loss": g_sum / seen, "d_loss": d_sum / seen})

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: torch.Tensor, ctx: fedmq.EvalContext) -> dict[str, float]:
        assert isinstance(model, GanModel)
        model.eval()
        fakes = model.sample(EVAL_SAMPLES, torch.Generator().manual_seed(ctx.seed)).cpu()
        return sample_quality(fakes, data)

    def export(self, model: nn.Module, ctx: fedmq.ExportContext) -> None:
        """After the last round: the grid of generated digits, as `samples.png` in ctx.out_dir."""
        write_samples(model, Path(ctx.out_dir) / "samples.png", seed=ctx.seed)


def sample_quality(fake: torch.Tensor, real: torch.Tensor) -> dict[str, float]:
    """mmd (unbiased MMD², Gaussian kernel, σ = SIGMA) and nn_distance; images (n, 64) in [0, 1]."""
    fake, real = fake.reshape(len(fake), -1).double(), real.reshape(len(real), -1).double()
    m, n = len(fake), len(real)

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).pow(2) / (2 * SIGMA**2))

    k_ff, k_rr, k_fr = kernel(fake, fake), kernel(real, real), kernel(fake, real)
    mmd = (
        (k_ff.sum() - k_ff.diagonal().sum()) / (m * (m - 1))
        + (k_rr.sum() - k_rr.diagonal().sum()) / (n * (n - 1))
        - 2 * k_fr.mean()
    )
    nearest = torch.cdist(fake, real).min(dim=1).values.mean()
    return {"mmd": float(mmd), "nn_distance": float(nearest)}


def write_samples(
    model: nn.Module, path: str | Path, *, rows: int = 8, seed: int = 0, scale: int = 4
) -> Path:
    """A rows x rows grid of generated digits as a grayscale PNG, ink dark on white, each pixel
    drawn `scale` times larger; returns the path."""
    assert isinstance(model, GanModel)
    with torch.no_grad():
        model.eval()
        images = model.sample(rows * rows, torch.Generator().manual_seed(seed)).cpu().numpy()
    tiles = images.reshape(rows, rows, 8, 8)
    pad = np.zeros((rows, rows, 10, 10))  # a 1-pixel white border around each tile
    pad[:, :, 1:9, 1:9] = tiles
    grid = pad.transpose(0, 2, 1, 3).reshape(rows * 10, rows * 10)
    big = np.kron(grid, np.ones((scale, scale)))
    pixels = np.round(255 * (1 - np.clip(big, 0, 1))).astype(np.uint8)
    path = Path(path)
    import matplotlib.image

    matplotlib.image.imsave(path, pixels, cmap="gray", vmin=0, vmax=255)
    return path


def _mlp(widths: list[int]) -> list[nn.Module]:
    """Linear layers of the given widths with LeakyReLU(0.2) between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.LeakyReLU(0.2))
    return layers


def _index(positions: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(positions)


@functools.lru_cache(maxsize=4)
def _digits(test_fraction: float, seed: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Every image as (n, 64) float32 in [0, 1], with the training and held-out indices."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    train, test = stratified_split(raw.target, test_fraction, seed)
    return torch.from_numpy((raw.data / 16.0).astype(np.float32)), train, test


@functools.lru_cache(maxsize=8)
def _parts(test_fraction: float, seed: int, num_clients: int) -> list[np.ndarray]:
    _, train, _ = _digits(test_fraction, seed)
    return partition(np.zeros(len(train), dtype=np.int64), num_clients, IidPartition(), seed)
