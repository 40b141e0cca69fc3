"""A character-level language model where each client is one module of Python's standard library.

The text ships with every Python: the running interpreter's stdlib directory
(`sysconfig.get_paths()["stdlib"]`). The candidates are its top-level `.py` files whose size
lies in a band (min_kb..max_kb, names not starting with "_"), sorted by name; a permutation
seeded by the job's seed gives the first `held_out` to the server and the next `num_clients`
to the clients, one module each (or name them: `modules`, then `held_out_modules`). Modules
differ in vocabulary, style and length: the clients are naturally non-IID. Different Python
versions ship different files, so the choice is the same for every process on one interpreter.

Text is cut into non-overlapping windows of `context + 1` characters over a 98-symbol
alphabet (printable ASCII, newline, tab, and one symbol for anything else). A client trains on
its module's first (1 - val_fraction) and validates on the tail; the server evaluates on the
held-out modules, which no client has seen.

A loss-level Task (fedmq runs the loop): a GRU predicts each next character. `evaluate` sums
the negative log-likelihood over every predicted character and reports

    loss         mean NLL per character, in nats
    perplexity   exp(loss)

with the character count as the example count, so the example-weighted mean of `loss` over
clients is the NLL of their union, and `perplexity`'s rule, "geometric" (an example-weighted
geometric mean), is exactly exp of that: the perplexity of the union. `unigram_perplexity`
is the baseline: character frequencies of all clients' training text, scored on the same
held-out characters.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

import fedmq

# Symbol ids: 0 anything else, 1 newline, 2 tab, 3.. printable ASCII (space to tilde).
VOCAB = 3 + (127 - 32)
_CODES = np.zeros(256, dtype=np.int64)
_CODES[ord("\n")], _CODES[ord("\t")] = 1, 2
_CODES[32:127] = np.arange(3, VOCAB)


class CharLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    modules: list[str] | None = Field(None, description="the clients' modules by name, one per client")
    held_out_modules: list[str] | None = Field(None, description="the server's modules, with `modules`")
    min_kb: float = Field(10, ge=0)
    max_kb: float = Field(30, gt=0)
    held_out: int = Field(3, ge=1, description="modules held out for the server's evaluation")
    val_fraction: float = Field(0.1, gt=0, lt=1)
    context: int = Field(64, gt=0, description="characters per training window")
    embed: int = Field(16, gt=0)
    hidden: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _paired(self) -> CharLMOptions:
        if (self.modules is None) != (self.held_out_modules is None):
            raise ValueError("name both `modules` and `held_out_modules`, or neither")
        return self


class CharModel(nn.Module):
    """Embedding → GRU → logits over the alphabet, for every position of a window."""

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


class CharLM(fedmq.Task):
    """Next-character prediction on stdlib modules, one module per client; metric perplexity."""

    Options = CharLMOptions
    objective = fedmq.Objective("server.perplexity", "min")
    metric_reduction = {"perplexity": "geometric"}
    options: CharLMOptions

    def build_model(self) -> nn.Module:
        return CharModel(self.options.embed, self.options.hidden)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        clients, _ = choose_modules(self.options, ctx)
        codes = encode(read_module(clients[ctx.client]))
        cut = int(len(codes) * (1 - self.options.val_fraction))
        return fedmq.ClientData(
            train=windows(codes[:cut], self.options.context), val=windows(codes[cut:], self.options.context)
        )

    def load_server_data(self, ctx: fedmq.DataContext) -> torch.Tensor:
        _, held_out = choose_modules(self.options, ctx)
        return torch.cat([windows(encode(read_module(name)), self.options.context) for name in held_out])

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: torch.Tensor, ctx: fedmq.EvalContext) -> fedmq.EvalResult:
        model.eval()
        total, count = 0.0, 0
        for batch in data.split(ctx.batch_size):
            batch = batch.to(ctx.device)
            logits = model(batch[:, :-1])
            targets = batch[:, 1:].reshape(-1)
            nll = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets, reduction="none")
            total, count = total + float(nll.double().sum()), count + targets.numel()
        loss = total / max(count, 1)
        return fedmq.EvalResult(count, {"loss": loss, "perplexity": math.exp(loss)})


def unigram_perplexity(train: list[torch.Tensor], test: torch.Tensor) -> float:
    """The perplexity on `test`'s predicted characters (every window's [1:]) of character
    frequencies counted over `train`'s, add-one smoothed over the alphabet."""
    counts = torch.ones(VOCAB, dtype=torch.float64)
    for part in train:
        counts += torch.bincount(part[:, 1:].reshape(-1), minlength=VOCAB).double()
    logp = (counts / counts.sum()).log()
    targets = test[:, 1:].reshape(-1)
    return math.exp(-float(logp[targets].mean()))


def baseline(task: CharLM, seed: int, num_clients: int) -> float:
    """The unigram baseline of a job: all its clients' training text, scored on the server's."""
    train = [task.load_data(fedmq.DataContext(c, num_clients, seed)).train for c in range(num_clients)]
    return unigram_perplexity(train, task.load_server_data(fedmq.DataContext(-1, num_clients, seed)))


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def candidates(min_kb: float, max_kb: float) -> tuple[str, ...]:
    """Top-level stdlib modules whose source is min_kb..max_kb, by name (no private `_` ones)."""
    return tuple(
        path.stem
        for path in sorted(stdlib().glob("*.py"))
        if not path.name.startswith("_") and min_kb * 1024 <= path.stat().st_size <= max_kb * 1024
    )


def choose_modules(options: CharLMOptions, ctx: fedmq.DataContext) -> tuple[list[str], list[str]]:
    """(the clients' modules, one per client; the server's held-out modules); see the docstring."""
    num_clients = ctx.num_clients
    if options.modules is not None and options.held_out_modules is not None:
        if len(options.modules) != num_clients:
            raise ValueError(f"`modules` names {len(options.modules)} modules for {num_clients} clients")
        return list(options.modules), list(options.held_out_modules)
    pool = candidates(options.min_kb, options.max_kb)
    needed = options.held_out + num_clients
    if needed > len(pool):
        raise ValueError(
            f"{num_clients} clients and {options.held_out} held-out modules need {needed} stdlib modules; "
            f"{len(pool)} lie within {options.min_kb}-{options.max_kb} KB: widen the band or name `modules`"
        )
    order = ctx.rng("stdlib-modules").permutation(len(pool))  # the seed's, whoever asks
    chosen = [pool[i] for i in order[:needed]]
    return chosen[options.held_out :], chosen[: options.held_out]


def read_module(name: str) -> bytes:
    path = stdlib() / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no standard-library module {name!r} at {path}")
    return path.read_bytes()


def encode(text: bytes) -> torch.Tensor:
    """Bytes as symbol ids (int64)."""
    return torch.from_numpy(_CODES[np.frombuffer(text, dtype=np.uint8)])


def windows(codes: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping (n, context + 1) windows; each window's last symbol starts the next one's
    prediction, so every symbol after the first is predicted once."""
    n = (len(codes) - 1) // context
    if n < 1:
        return torch.empty(0, context + 1, dtype=torch.int64)
    starts = torch.arange(n) * context
    return codes[starts[:, None] + torch.arange(context + 1)]

