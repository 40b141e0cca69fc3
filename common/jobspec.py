"""Job spec: the YAML a user writes, validated by pydantic. Unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedmq.common.codec.compress import CompressionSpec
from fedmq.common.errors import ConfigError, SetupError
from fedmq.common.refs import check_strategy_name, ref_of
from fedmq.common.sites import SITE_NAME
from fedmq.common.speclimits import check_tree, load_yaml

REF = r"^([A-Za-z_][\w]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$"  # a built-in name or package.module:Name


class Spec(BaseModel):
    """Base for every spec section: strict keys, immutable."""

    # strict: YAML's `true` is not a round count and "5" is not a batch size.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _named(data: Any) -> Any:
    """A spec section given as just its name, or from Python as the class itself, in its dict form."""
    if isinstance(data, str | type):
        data = {"name": data}
    if isinstance(data, dict) and isinstance(data.get("name"), type):
        data = {**data, "name": ref_of(data["name"])}
    return data


class TaskSpec(Spec):
    """The workload: a built-in Task by name (`digits`) or `package.module:Name`, and its options."""

    name: Annotated[str, Field(pattern=REF, max_length=200)] = "digits"
    options: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`task: digits`, and from Python a Task class itself (`task=MyTask`)."""
        return _named(data)


class ClientsSpec(Spec):
    """How many clients exist (logical ones, or named sites), how many train each round, the quorum."""

    total: int = Field(gt=0)
    # Cross-silo: the clients are these sites, client i is sites[i]; each site's tasks go only to a
    # learner hosting it (FEDMQ_SITES), and a site with none alive is a dropped client that round.
    sites: list[str] | None = Field(
        None, min_length=1, description="named sites as the clients (total is then their number)"
    )
    per_round: int | None = Field(None, gt=0, description="defaults to total")
    min_fit: int | None = Field(None, gt=0, description="defaults to per_round")
    # A learner's user code raising (data, model or training): the job fails at once, naming the
    # client, round, phase and error (the default: such a bug is rarely one client's); or that
    # client is dropped from the round, which closes at quorum (min_fit) or is retried.
    on_error: Literal["fail_job", "drop_client"] = "fail_job"
    # Plausible updates (the aggregator checks; a refused update is dead-lettered and counted).
    # A client's example count weighs its update: it may not exceed max_examples, nor the count of
    # the client's first accepted update (its shard does not grow during a job).
    max_examples: int | None = Field(
        None, gt=0, description="largest example count one client's update may claim"
    )
    # ‖update − global‖ (L2 over all floating tensors) above this: the update is rejected, or its
    # delta scaled down to the bound (clip). Robust strategies are the second line.
    max_update_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="largest L2 norm of one client's update delta"
    )
    on_large_update: Literal["reject", "clip"] = "reject"

    @model_validator(mode="before")
    @classmethod
    def _total_of_sites(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sites"), list):
            sites = data["sites"]
            if data.get("total") is None:
                data = {**data, "total": len(sites)}
            elif data["total"] != len(sites):
                raise ValueError(f"total ({data['total']}) must equal the number of sites ({len(sites)}), "
                                 "or be left out")
        return data

    @model_validator(mode="after")
    def _ordered(self) -> ClientsSpec:
        if self.sites is not None:
            bad = [site for site in self.sites if not SITE_NAME.match(site)]
            if bad:
                raise ValueError(f"site names {bad} must be letters, digits, '-' and '_', at most 64")
            if len(set(self.sites)) != len(self.sites):
                raise ValueError("each site may be named once")
            if any(site.startswith("learner--") for site in self.sites):
                raise ValueError("site names starting with learner-- are learners' own queues")
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

    def site(self, client: int) -> str | None:
        """The site client `client` is, or None for a logical client."""
        return None if self.sites is None else self.sites[client]


class DpSgdSpec(Spec):
    """Local DP-SGD: each example's gradient clipped to `clip_norm`, their sum noised (dpsgd.py)."""

    clip_norm: float = Field(gt=0, allow_inf_nan=False, description="C: each example's gradient norm bound")
    noise_multiplier: float = Field(
        ge=0, allow_inf_nan=False, description="z: Gaussian noise of std z·C on each step's summed gradient",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="the δ that train.dp_epsilon is reported at")


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
    fuse: bool | None = Field(
        None, description="train a learner's clients of a round together (vmap over stacked weights): null, "
        "the default, wherever the Task (loss-level, indexable data) and model allow it; false: one at a "
        "time. Within 1e-5 of one at a time, and bit-identical however grouped on CPU",
    )
    keep_optimizer_state: bool = Field(
        False, description="fedmq's loop keeps each client's optimizer state (SGD's momentum, Adam's "
        "moments and steps) in its client state between its rounds, instead of starting afresh each round",
    )
    dp_sgd: DpSgdSpec | None = Field(
        None, description="train with DP-SGD (per-example clipping and Gaussian noise), a Task at the loss "
        "level; each client reports train.dp_epsilon, its (ε, δ) spent if it took part in every round",
    )


class PersonalizeSpec(Spec):
    """Each client keeps a model of its own beside the global one (fedmq's loop, a loss-level Task).

    fedper (Arivazhagan et al. 2019): the parameters matching `layers` are each client's own; they
    train with the rest, stay in its client state and never go into its update (it sends the
    round's global values there, and the aggregator keeps its own). ditto (Li et al. 2021): each
    client also trains a whole personal model, pulled toward the round's global model by
    `lam`/2·||v − w||², kept in its client state; its update is FedAvg's, unchanged. A client's
    personal model is evaluated on its validation data next to the global one (`personal.*`).
    Refused: ditto with train.dp_sgd, fedper with SCAFFOLD.
    """

    method: Literal["fedper", "ditto"]
    layers: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        [], max_length=64, description="fedper: the personal parameters, by name pattern (fnmatch: `2.*`)",
    )
    lam: float = Field(0.1, gt=0, allow_inf_nan=False, description="ditto: the pull toward the global model")

    @model_validator(mode="after")
    def _layers(self) -> PersonalizeSpec:
        if self.method == "fedper" and not self.layers:
            raise ValueError("personalize.method fedper needs layers: the parameters each client keeps, "
                             "by name pattern (for an MLP's last layer, `layers: [\"3.*\"]`)")
        if self.method == "ditto" and self.layers:
            raise ValueError("personalize.layers is fedper's: ditto keeps a whole model per client")
        return self


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

    metric: Annotated[str, Field(pattern=r"^(train|federated|personal|server|strategy)\.[A-Za-z_][\w.]*$")]
    mode: Literal["min", "max"] = "max"


class StrategySpec(Spec):
    """The server strategy: a built-in by name (`fedavg`) or `package.module:Class`, and its options.

    The options are the strategy's own (its `Options` model checks them where the strategy is
    built: the CLI before publishing, and the aggregator). Older specs wrote the options beside
    the name (`{name: fedavgm, server_momentum: 0.5}`) or the name alone; both still read.
    """

    name: Annotated[str, Field(pattern=REF, max_length=200)] = "fedavg"
    options: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`strategy: fedavg`, the flat form, and from Python a Strategy class itself."""
        data = _named(data)
        if isinstance(data, dict) and "options" not in data and set(data) - {"name"}:
            options = {k: v for k, v in data.items() if k != "name"}
            data = {"name": data.get("name", "fedavg"), "options": options}
        return data

    @model_validator(mode="after")
    def _known(self) -> StrategySpec:
        try:
            check_strategy_name(self.name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class DdpSpec(Spec):
    """A data-parallel job: one torch.distributed group running the user's entry (seed 003).

    The scheduler picks `world_size` idle learners (on `nodes`, if named), ranks them by seed
    003's rules (the master node first, other nodes by name, workers by replica, local ranks
    from 0 per node) and each starts `entry` as a child process with MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, RANK, LOCAL_RANK and NODE_RANK set, as torchrun would. A rank failing or its
    learner dying tears the group down and starts it again from the last checkpoint the entry
    saved (fedmq.ddp), up to `max_restarts` times.
    """

    entry: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*$", max_length=200)] = Field(
        description="package.module:function, called with no arguments in each rank's process"
    )
    world_size: int = Field(gt=0, le=1024)
    nodes: list[str] = Field([], description="only learners on these nodes (FEDMQ_NODE); empty: any")
    master_node: str = Field("", description="the node of rank 0; default: the first chosen learner's")
    master_addr: str = Field("", max_length=253, description="how ranks reach the master; default: its node")
    master_port: int = Field(29500, gt=0, lt=65536)
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on GPUs, gloo on CPUs")
    max_restarts: int = Field(0, ge=0, le=100)
    options: dict[str, Any] = Field({}, description="free-form, for the entry (fedmq.ddp.options())")


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
    strategy: StrategySpec = StrategySpec()
    compression: CompressionSpec = Field(
        CompressionSpec(), description="how learners compress their updates (default none: full weights)"
    )
    personalize: PersonalizeSpec | None = None
    round_timeout_s: float = Field(600.0, gt=0)
    max_round_retries: int = Field(2, ge=0)
    # A data-parallel job instead of a federated one: no clients, rounds or Task of its own.
    ddp: DdpSpec | None = None

    _legacy = model_validator(mode="before")(lambda data: legacy_workload(data))

    @model_validator(mode="before")
    @classmethod
    def _ddp_defaults(cls, data: Any) -> Any:
        """A DDP job is one group run: one 'client', one 'round', in the job's bookkeeping."""
        if isinstance(data, dict) and isinstance(data.get("ddp"), dict):
            data = {"clients": {"total": 1}, "rounds": 1, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _compression_shorthand(cls, data: Any) -> Any:
        """`compression: int8` for `compression: {codec: int8}`."""
        if isinstance(data, dict) and isinstance(data.get("compression"), str):
            data = {**data, "compression": {"codec": data["compression"]}}
        return data

    def with_changes(self, **changes: Any) -> JobSpec:
        """A copy with top-level fields replaced; a dict merges into the section it names."""
        raw = self.model_dump(mode="json")
        for key, value in changes.items():
            current = raw.get(key)
            merged = isinstance(value, dict) and isinstance(current, dict)
            raw[key] = {**current, **value} if merged else value  # type: ignore[dict-item]
        return type(self).model_validate(raw)

    @model_validator(mode="after")
    def _task_given(self) -> JobSpec:
        if "task" not in self.model_fields_set and self.ddp is None:
            raise ValueError(
                "task is missing: name the Task the job trains, `task: digits` for the built-in digits "
                "classifier or `task: {name: \"my_pkg.tasks:MyTask\"}` for your own (see examples/)")
        return self

    @model_validator(mode="after")
    def _personalize_fits(self) -> JobSpec:
        personal = self.personalize
        if personal is None:
            return self
        if personal.method == "ditto" and self.train.dp_sgd is not None:
            raise ValueError(
                "personalize ditto with train.dp_sgd: the personal model would train on the client's data "
                "without noise and be kept with its state; use fedper (its layers train with DP-SGD) or "
                "drop one")
        if personal.method == "fedper" and self.strategy.name == "scaffold":
            raise ValueError("personalize fedper with strategy scaffold: the control variates would mix "
                             "each client's own layers into the shared ones; pick another strategy")
        return self

    @model_validator(mode="after")
    def _objective_measured(self) -> JobSpec:
        if self.objective is not None and not self.measures(self.objective.metric):
            source = self.objective.metric.partition(".")[0]
            fix = "evaluate.server: true" if source == "server" else "evaluate: {federated: {clients: N}}"
            if source == "personal" and self.personalize is None:
                fix = "personalize: {method: ditto}"
            raise ValueError(
                f"objective.metric {self.objective.metric!r} is never measured: this job has no {source} "
                f"evaluation; add `{fix}` or pick another metric"
            )
        return self

    def measures(self, metric: str) -> bool:
        """Whether the job evaluates where `source.name` comes from (server or federated evaluation)."""
        source = metric.partition(".")[0]
        if source == "server":
            return self.evaluate.server
        if source == "federated":
            return self.evaluate.federated is not None
        if source == "personal":
            return self.evaluate.federated is not None and self.personalize is not None
        return True

    def evaluates(self, server_round: int) -> bool:
        """Whether the global model of this round is evaluated (round 0 is the initial model)."""
        return server_round % self.evaluate.every == 0 or server_round == self.rounds


class Job(JobSpec):
    """`fedmq.Job(...)`: a JobSpec checked as a YAML spec is, its errors one ConfigError naming each
    field (and suggesting the key a typo meant), not pydantic's."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"job spec is invalid:\n{format_errors(exc)}") from None


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
    """Validate a mapping as a job spec, raising ConfigError that names every bad field.

    Its size, depth and options blobs are bounded first (speclimits: SpecTooLarge).
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    check_tree(raw, source)
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{format_errors(exc)}") from None


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a YAML job spec from disk; overrides are dotted keys like {'train.lr': 0.1}."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SetupError(f"cannot read job spec {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
            "save it as UTF-8, or check it is the job spec"
        ) from None
    try:
        raw = load_yaml(text, str(path))
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
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")  # our own checks' messages say it all
        lines.append(f"  - {'.'.join(path) or '(top level)'}: {msg}")
    return "\n".join(lines)


def _resolve(loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """The YAML path of an error location, and the spec section it ends in (if any)."""
    section: type[BaseModel] | None = JobSpec
    path: list[str] = []
    for part in loc:
        path.append(str(part))
        field = section.model_fields.get(str(part)) if section is not None else None
        annotation = field.annotation if field is not None else None
        # An optional section (`X | None`) is the section X.
        options = [a for a in get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            annotation = options[0]
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        section = annotation if is_model else None  # type: ignore[assignment]
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

