"""Job spec: the YAML a user writes, validated by pydantic. Unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedmq.common.errors import ConfigError

REF = r"^([A-Za-z_][\w]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$"  # a built-in name or package.module:Name


class Spec(BaseModel):
    """Base for every spec section: strict keys, immutable."""

    # strict: YAML's `true` is not a round count and "5" is not a batch size.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TaskSpec(Spec):
    """The workload: a built-in Task by name (`digits`) or `package.module:Name`, and its options."""

    name: Annotated[str, Field(pattern=REF, max_length=200)] = "digits"
    options: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`task: digits`, and from Python a Task class itself (`task=MyTask`)."""
        if isinstance(data, str | type):
            data = {"name": data}
        if isinstance(data, dict) and isinstance(data.get("name"), type):
            from fedmq.common.task.loading import ref_of

            data = {**data, "name": ref_of(data["name"])}
        return data


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
    """Local training on each client: fedmq's loop for a loss-level Task, or hints for a Task's own."""

    epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop local training after this many steps")
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    options: dict[str, Any] = Field({}, description="free-form settings for a Task's own train()")


class FederatedEvalSpec(Spec):
    """Clients evaluate the global model on their own validation data."""

    clients: int = Field(gt=0, description="clients sampled to evaluate, per evaluation")
    min: int | None = Field(None, gt=0, description="reports needed; defaults to clients")

    @property
    def quorum(self) -> int:
        return self.min if self.min is not None else self.clients


class EvaluateSpec(Spec):
    """When and where global models are evaluated."""

    every: int = Field(1, gt=0, description="rounds between evaluations; the last round always is")
    server: bool = Field(True, description="the aggregator evaluates on the Task's server data, if any")
    federated: FederatedEvalSpec | None = None


class ObjectiveSpec(Spec):
    """The metric that picks the best round and the best model: `source.name`, minimised or maximised."""

    metric: Annotated[str, Field(pattern=r"^(train|federated|server|strategy)\.[A-Za-z_][\w.]*$")]
    mode: Literal["min", "max"] = "max"


class FedAvgStrategy(Spec):
    name: Literal["fedavg"] = "fedavg"


class AverageStrategy(Spec):
    name: Literal["average"] = "average"


class FedAvgMStrategy(Spec):
    name: Literal["fedavgm"] = "fedavgm"
    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.9, ge=0, lt=1)


class WeightedStrategy(Spec):
    """FedAvg with the user's weight per client (seed 002's `weighted`); clients past the list count 1."""

    name: Literal["weighted"] = "weighted"
    weights: list[Annotated[float, Field(ge=0)]] = []


class MovingAverageStrategy(Spec):
    """A moving average of the global weights (seed 002's `momentum`): w ← m·w + (1 − m)·average."""

    name: Literal["moving_average"] = "moving_average"
    momentum: float = Field(0.9, ge=0, lt=1)


Strategy = Annotated[
    FedAvgStrategy | AverageStrategy | FedAvgMStrategy | WeightedStrategy | MovingAverageStrategy,
    Field(discriminator="name"),
]


class JobSpec(Spec):
    """A whole federated job."""

    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][\w.-]*$")]
    seed: int = Field(0, ge=0, lt=2**63)
    task: TaskSpec = TaskSpec()
    clients: ClientsSpec
    rounds: int = Field(gt=0, le=100_000)
    train: TrainSpec = TrainSpec()
    evaluate: EvaluateSpec = EvaluateSpec()
    objective: ObjectiveSpec | None = None
    strategy: Strategy = FedAvgStrategy()
    round_timeout_s: float = Field(600.0, gt=0)
    max_round_retries: int = Field(2, ge=0)

    _legacy = model_validator(mode="before")(lambda data: legacy_workload(data))

    def with_changes(self, **changes: Any) -> JobSpec:
        """A copy with top-level fields replaced; a dict merges into the section it names."""
        raw = self.model_dump(mode="json")
        for key, value in changes.items():
            current = raw.get(key)
            merged = isinstance(value, dict) and isinstance(current, dict)
            raw[key] = {**current, **value} if merged else value  # type: ignore[dict-item]
        return type(self).model_validate(raw)

    def evaluates(self, server_round: int) -> bool:
        """Whether the global model of this round is evaluated (round 0 is the initial model)."""
        return server_round % self.evaluate.every == 0 or server_round == self.rounds


def legacy_workload(data: Any) -> Any:
    """Specs written before Tasks: `model`/`data` sections name the built-in digits Task's options.

    The plug-in entrypoints of those sections and `train.entrypoint` are gone: their error
    shows the Task that replaces them.
    """
    if not isinstance(data, dict):
        return data
    train = data.get("train")
    if isinstance(train, dict) and "entrypoint" in train:
        raise ValueError(
            "train.entrypoint is replaced by a Task: give your Task a train(model, data, ctx) method "
            "returning fedmq.TrainResult, or just a loss(model, batch) and let fedmq run the loop; "
            "name it with `task: {name: \"my_pkg.tasks:MyTask\"}` (see examples/plugins/my_task.py)"
        )
    if not ({"model", "data"} & data.keys()):
        return data
    if "task" in data:
        raise ValueError("'model' and 'data' are options of the digits task: move them under task.options")
    data = dict(data)
    model, dataset = data.pop("model", {}) or {}, data.pop("data", {}) or {}
    if not isinstance(model, dict) or not isinstance(dataset, dict):
        raise ValueError("'model' and 'data' must be mappings")
    if "entrypoint" in model or "entrypoint" in dataset:
        raise ValueError(
            "model.entrypoint and data.entrypoint are replaced by one Task class: write "
            "`task: {name: \"my_pkg.tasks:MyTask\", options: {...}}` whose build_model() and load_data() "
            "do what your builder and loader did (see examples/plugins/my_task.py)"
        )
    if dataset.get("name", "digits") != "digits":
        raise ValueError(f"data.name {dataset.get('name')!r}: the only built-in dataset is digits")
    options = {k: v for k, v in {
        "model": {k: v for k, v in model.items() if k != "options"} or None,
        "test_fraction": dataset.get("test_fraction"),
        "partition": dataset.get("partition"),
    }.items() if v is not None}
    extra = set(dataset) - {"name", "test_fraction", "partition", "options"}
    if extra:
        raise ValueError(f"data: unknown key(s) {sorted(extra)}; allowed: name, test_fraction, partition")
    data["task"] = {"name": "digits", "options": options}
    return data


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
        (JobSpec, "strategy"): {
            "fedavg": FedAvgStrategy, "average": AverageStrategy, "fedavgm": FedAvgMStrategy,
            "weighted": WeightedStrategy, "moving_average": MovingAverageStrategy,
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
        # An optional section (`X | None`) is the section X.
        options = [a for a in get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            annotation = options[0]
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

