"""Cross-silo digits: each site's data is a file on its own learner's machine, nowhere else.

A site `hospital-a` is a learner started with FEDMQ_SITES=hospital-a and FEDMQ_DATA_DIR=/data,
where `/data/hospital-a.npz` holds that site's images (x) and labels (y), with a held-out part
(x_val, y_val) for federated evaluation. The scheduler sends a site's tasks to its learner only;
`load_data` reads the file named after the site from that learner's data directory. There is no
server data: the model is evaluated where the data lives (`evaluate.federated`).

Make the files for a try on one machine (each site gets a label-skewed share of the digits):

    python -m examples.sites /tmp/site-a hospital-a hospital-b
    python -m examples.sites /tmp/site-b hospital-c hospital-d

A loss-level Task: fedmq runs the training loop; evaluation is the mean loss and accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import fedmq
from fedmq.tasks.digits import INPUT_SHAPE, NUM_CLASSES, mlp

Split = tuple[torch.Tensor, torch.Tensor]


class SiteOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    hidden: list[Annotated[int, Field(gt=0)]] = [64]


class SiteDigits(fedmq.Task):
    """An MLP on 8x8 digits whose every client is a site reading `<data_dir>/<site>.npz`."""

    Options = SiteOptions
    objective = fedmq.Objective("federated.accuracy", "max")
    options: SiteOptions

    def build_model(self) -> nn.Module:
        return mlp(INPUT_SHAPE, NUM_CLASSES, self.options.hidden)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        if ctx.site is None or ctx.data_dir is None:
            raise ValueError(
                "SiteDigits needs named sites (clients: {sites: [...]}) and each learner's "
                "FEDMQ_DATA_DIR holding <site>.npz"
            )
        path = Path(ctx.data_dir) / f"{ctx.site}.npz"
        if not path.is_file():
            raise FileNotFoundError(f"site {ctx.site}: no {path} on this learner (python -m examples.sites)")
        with np.load(path, allow_pickle=False) as arrays:
            return fedmq.ClientData(
                train=(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])),
                val=(torch.from_numpy(arrays["x_val"]), torch.from_numpy(arrays["y_val"])),
            )

    def loss(self, model: nn.Module, batch: Split) -> tuple[torch.Tensor, dict]:
        x, y = batch
        logits = model(x)
        accuracy = (logits.detach().argmax(dim=1) == y).float().mean()
        return nn.functional.cross_entropy(logits, y), {"accuracy": accuracy}


def write_sites(out_dir: Path, sites: list[str], all_sites: list[str] | None = None, seed: int = 0) -> None:
    """Write `<site>.npz` for each of `sites`: its share of the digits when split over `all_sites`.

    Shares are label-skewed (each site sees mostly some digits) and the same whichever machine
    writes them, so two machines each writing their own sites split one dataset between them.
    """
    from sklearn.datasets import load_digits

    every = all_sites or sites
    images, labels = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    order = order[np.argsort(labels[order] % len(every), kind="stable")]  # skew: digits by site
    x = (images[order] / 16.0).astype(np.float32).reshape(-1, *INPUT_SHAPE)
    y = labels[order].astype(np.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    for index, site in enumerate(every):
        if site not in sites:
            continue
        part = np.array_split(np.arange(len(y)), len(every))[index]
        cut = int(len(part) * 0.8)
        train, val = part[:cut], part[cut:]
        np.savez(out_dir / f"{site}.npz", x=x[train], y=y[train], x_val=x[val], y_val=y[val])


SITES = ["hospital-a", "hospital-b", "hospital-c", "hospital-d"]  # examples/sites.yaml's

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m examples.sites DIR SITE [SITE ...]   (sites of examples/sites.yaml: "
                 + " ".join(SITES) + ")")
    names = sys.argv[2:]
    write_sites(Path(sys.argv[1]), names, all_sites=sorted(set(SITES) | set(names)))
