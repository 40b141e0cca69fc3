"""Job spec: the YAML a user writes, validated by pydantic. Unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedmq.common.errors import ConfigError

ENTRYPOINT = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


def _source_first(data: Any) -> Any:
    """With an entrypoint and no name, the built-in default name does not apply."""
    if isinstance(data, dict) and data.get("entrypoint") and "name" not in data:
        return {**data, "name": None}
    return data


class Spec(BaseModel):
    """Base for every spec section: strict keys, immutable."""

    # strict: YAML's `true` is not a round count and "5" is not a batch size.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(Spec):
    """Which network to train: a built-in by name or a user's `pkg.mod:build` function."""

    name: Literal["mlp", "cnn"] | None = "mlp"
    hidden: list[Annotated[int, Field(gt=0)]] = [128]
    channels: list[Annotated[int, Field(gt=0)]] = [16, 32]
    entrypoint: Annotated[str, Field(pattern=ENTRYPOINT)] | None = None
    options: dict[str, Any] = {}

    _no_name_with_entrypoint = model_validator(mode="before")(lambda data: _source_first(data))

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.entrypoint is not None and self.name is not None:
            raise ValueError("give either 'name' or 'entrypoint', not both")
        return self


class IidPartition(Spec):
    kind: Literal["iid"] = "iid"


class DirichletPartition(Spec):
    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0)
    min_size: int = Field(1, ge=0, description="resample until every client has this many samples")


class ShardsPartition(Spec):
    kind: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, gt=0)


Partition = Annotated[
    IidPartition | DirichletPartition | ShardsPartition, Field(discriminator="kind")
]


class DataSpec(Spec):
    """Which data and how it is split over clients."""

    name: Literal["digits"] | None = "digits"
    entrypoint: Annotated[str, Field(pattern=ENTRYPOINT)] | None = None
    options: dict[str, Any] = {}
    test_fraction: float = Field(0.2, gt=0, lt=1)
    partition: Partition = DirichletPartition()

    _no_name_with_entrypoint = model_validator(mode="before")(lambda data: _source_first(data))

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.entrypoint is not None and self.name is not None:
            raise ValueError("give either 'name' or 'entrypoint', not both")
        return self


class ClientsSpec(Spec):
    """How many logical clients exist, how many train each round, and the quorum."""

    total: int = Field(gt=0)
    per_round: int | None = Field(None, gt=0, description="defaults to total")
    min_fit: int | None = Field(None, gt=0, description="defaults to per_round")
    # A learner's user code raising (data, model or training): the job fails at once, naming the
    # client, round, phase and error (the default: such a bug is rarely one client's); or that
    # client is dropped from the round, which closes at quorum (min_fit) or is retried.
    on_error: Literal["fail_job", "drop_client"] = "fail_job"

    @model_validator(mode="after")
    def _ordered(self) -> ClientsSpec:
        if self.per_round is not None and self.per_round > self.total:
            raise ValueError(
                f"per_round ({self.per_round}) must not exceed total ({self.total})"
            )
        if self.min_fit is not None and self.min_fit > self.sampled:
            raise ValueError(f"min_fit ({self.min_fit}) must not exceed per_round ({self.sampled})")
        return self

    @property
    def sampled(self) -> int:
        return self.per_round if self.per_round is not None else self.total

    @property
    def quorum(self) -> int:
        return self.min_fit if self.min_fit is not None else self.sampled


class TrainSpec(Spec):
    """Local training on each client."""

    epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop local training after this many steps")
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    entrypoint: Annotated[str, Field(pattern=ENTRYPOINT)] | None = Field(
        None, description="a user's own local training function"
    )


class FedAvgStrategy(Spec):
    name: Literal["fedavg"] = "fedavg"


class AverageStrategy(Spec):
    name: Literal["average"] = "average"


class FedAvgMStrategy(Spec):
    name: Literal["fedavgm"] = "fedavgm"
    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.9, ge=0, lt=1)


Strategy = Annotated[
    FedAvgStrategy | AverageStrategy | FedAvgMStrategy, Field(discriminator="name")
]


class JobSpec(Spec):
    """A whole federated job."""

    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][\w.-]*$")]
    seed: int = Field(0, ge=0, lt=2**63)
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    clients: ClientsSpec
    rounds: int = Field(gt=0, le=100_000)
    train: TrainSpec = TrainSpec()
    strategy: Strategy = FedAvgStrategy()
    round_timeout_s: float = Field(600.0, gt=0)
    max_round_retries: int = Field(2, ge=0)


def parse_job(raw: Any, source: str = "job spec") -> JobSpec:
    """Validate a mapping as a job spec, raising ConfigError that names every bad field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{format_errors(exc)}") from None


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a YAML job spec from disk; overrides are dotted keys like {'train.lr': 0.1}."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read job spec {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if isinstance(raw, dict):
        for dotted, value in (overrides or {}).items():
            _set_dotted(raw, dotted, value)
    return parse_job(raw, str(path))


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot override {dotted}: {key} is not a section")
    node[leaf] = value


def format_errors(exc: ValidationError) -> str:
    """One line per error: the dotted field path, what is wrong, and the allowed values."""
    lines = []
    for err in exc.errors():
        path, _ = _resolve(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key{_suggest(err['loc'])}"
        elif err["type"] == "literal_error":
            msg = f"{msg} (got {err.get('input')!r})"
        elif err["type"] == "union_tag_invalid":
            ctx = err.get("ctx", {})
            msg = f"unknown kind {ctx.get('tag')!r}; allowed: {ctx.get('expected_tags', '')}"
        lines.append(f"  - {'.'.join(path) or '(top level)'}: {msg}")
    return "\n".join(lines)


def _union_members() -> dict[tuple[type[BaseModel], str], dict[str, type[BaseModel]]]:
    return {
        (DataSpec, "partition"): {
            "iid": IidPartition, "dirichlet": DirichletPartition, "shards": ShardsPartition
        },
        (JobSpec, "strategy"): {
            "fedavg": FedAvgStrategy, "average": AverageStrategy, "fedavgm": FedAvgMStrategy
        },
    }


def _resolve(loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """The YAML path of an error location, and the spec section it ends in (if any).

    Discriminated unions put the member's tag into the location right after the
    union field; it is not part of the YAML path, so it is dropped there only.
    """
    unions = _union_members()
    section: type[BaseModel] | None = JobSpec
    path: list[str] = []
    i = 0
    while i < len(loc):
        part = loc[i]
        path.append(str(part))
        members = unions.get((section, str(part))) if section is not None else None
        if members is not None and i + 1 < len(loc) and loc[i + 1] in members:
            section = members[str(loc[i + 1])]
            i += 2
            continue
        field = section.model_fields.get(str(part)) if section is not None else None
        annotation = field.annotation if field is not None else None
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        section = annotation if is_model else None  # type: ignore[assignment]
        i += 1
    return path, section


def _suggest(loc: tuple[int | str, ...]) -> str:
    """For a misspelt key, name the closest allowed key of the section it sits in."""
    import difflib

    _, section = _resolve(loc[:-1])
    if section is None:
        return ""
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint}; allowed: {', '.join(allowed)}"


def canonical_json(spec: JobSpec) -> str:
    """A stable text form of a spec, used for hashing and persistence."""
    return spec.model_dump_json()

