"""What `fedmq run` and `fedmq submit` refuse before anything runs or is published, and how fast:
one line and exit 2 for a spec that is no text, a Task's own check of the job, a typo without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel
from torch import nn
from typer.testing import CliRunner

import fedmq
from fedmq.services.cli.main import app

REPO = Path(__file__).resolve().parents[2]


class FewSamples(fedmq.Task):
    """A Task whose data can feed at most three clients, and says so before the job starts."""

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def check_job(self, ctx: fedmq.DataContext) -> None:
        if ctx.num_clients > 3:
            raise ValueError(f"clients.total ({ctx.num_clients}) exceeds the 3 samples; lower it to 3")


def write(tmp_path: Path, data: bytes | str) -> str:
    path = tmp_path / "job.yaml"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_spec_that_is_not_utf8_is_one_error_line_and_exit_2(tmp_path: Path, command: str) -> None:
    job = write(tmp_path, "name: caf\xe9\nrounds: 1\n".encode("latin-1"))
    result = CliRunner().invoke(app, [command, job])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    first = result.output.splitlines()[0]
    assert first == (f"error: {job} is not UTF-8 text (byte 0xe9 on line 1); save it as UTF-8, "
                     "or check it is the job spec")


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_tasks_own_check_of_the_job_refuses_it_before_anything_runs(tmp_path: Path, command: str) -> None:
    task = f"{__name__}:FewSamples"
    job = write(tmp_path, f"name: few\nrounds: 1\ntask: {task}\nclients: {{total: 4}}\n")
    state = ["--state-dir", str(tmp_path / "state")] if command == "run" else []
    result = CliRunner().invoke(app, [command, job, *state])  # submit: refused before any broker
    assert result.exit_code == 2, result.output
    refusal = f"error: task '{task}' cannot run this job: clients.total (4) exceeds the 3 samples"
    assert refusal in result.output
    assert not (tmp_path / "state").exists()


def test_a_task_accepts_every_job_unless_it_checks() -> None:
    fedmq.Task().check_job(fedmq.DataContext(client=-1, num_clients=10**6, seed=0))  # raises nothing


def test_a_spec_typo_is_reported_without_importing_torch(tmp_path: Path) -> None:
    job = write(tmp_path, "name: typo\nrounds: 1\nclients: {total: 2}\nrouns: 3\n")
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from fedmq.services.cli.main import app\n"
        f"for command in ('run', 'submit'):\n"
        f"    result = CliRunner().invoke(app, [command, {job!r}])\n"
        "    assert result.exit_code == 2 and \"did you mean 'rounds'\" in result.output, result.output\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_spec_without_a_task_is_exit_2_naming_the_key(tmp_path: Path, command: str) -> None:
    job = write(tmp_path, "name: j\nclients: {total: 4}\nrounds: 1\n")
    result = CliRunner().invoke(app, [command, job])
    assert result.exit_code == 2, result.output
    assert "task is missing" in result.output and "task: digits" in result.output


def test_a_job_built_in_python_is_refused_as_its_yaml_would_be() -> None:
    from fedmq.common.errors import ConfigError

    with pytest.raises(ConfigError, match="rouds: unknown key; did you mean 'rounds'") as info:
        fedmq.Job(name="j", task="digits", clients={"total": 4}, rouds=3)
    assert "pydantic" not in str(info.value)
    with pytest.raises(ConfigError, match="task is missing"):
        fedmq.Job(name="j", clients={"total": 4}, rounds=1)
    assert isinstance(fedmq.Job(name="j", task="digits", clients={"total": 4}, rounds=1), fedmq.Job)


TRAILER = "Fix the job spec and run again"


@pytest.mark.parametrize("command", ["run", "submit"])
def test_the_fix_the_spec_trailer_follows_spec_errors_only(tmp_path: Path, command: str) -> None:
    cases = {
        str(tmp_path / "absent.yaml"): ("cannot read job spec", False),
        write(tmp_path, "name: j\ntask: {name: 'nosuchpkg.tasks:T'}\nclients: {total: 2}\nrounds: 1\n"):
            ("no module named 'nosuchpkg'", False),
    }
    for job, (message, trailer) in cases.items():
        result = CliRunner().invoke(app, [command, job])
        assert result.exit_code == 2 and message in result.output, result.output
        assert (TRAILER in result.output) is trailer, result.output
    typo = write(tmp_path, "name: j\ntask: digits\nclients: {total: 2}\nrouds: 1\n")
    result = CliRunner().invoke(app, [command, typo])
    assert result.exit_code == 2 and "did you mean 'rounds'" in result.output and TRAILER in result.output


class Inner(BaseModel):
    depth: int = 1


class Plain(BaseModel):
    """A plain pydantic model: by itself it ignores keys it does not declare."""

    width: int = 32
    inner: Inner = Inner()


class PlainOptions(fedmq.Task):
    Options = Plain

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)


def test_a_typo_in_a_tasks_plain_options_is_refused_with_the_key_it_meant() -> None:
    from fedmq.common.errors import ConfigError

    with pytest.raises(ConfigError, match="task.options.widht: unknown key; did you mean 'width'"):
        PlainOptions(widht=3)
    with pytest.raises(ConfigError, match="task.options.inner.detph: unknown key; did you mean 'depth'"):
        PlainOptions(inner={"detph": 2})
    assert PlainOptions(width=3, inner={"depth": 2}).options.inner.depth == 2


class NotData(fedmq.Task):
    """A loss-level Task whose load_data returns something fedmq's loop cannot batch."""

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def load_data(self, ctx: fedmq.DataContext) -> str:
        return "rows.csv"

    def loss(self, model: nn.Module, batch: object) -> object:
        raise AssertionError("never reached")


def test_data_fedmqs_loop_cannot_batch_fails_in_load_data_not_in_loss() -> None:
    from fedmq.common.jobspec import parse_job
    from fedmq.common.task.runtime import TaskRuntime
    from fedmq.common.usercode import UserCodeError

    spec = parse_job({"name": "j", "task": f"{__name__}:NotData", "clients": {"total": 2}, "rounds": 1})
    with pytest.raises(UserCodeError) as info:
        TaskRuntime.for_job(spec).load_data(0, None)
    assert info.value.phase == "load_data"
    assert "training data load_data returned is a str" in info.value.message


class Raising(fedmq.Task):
    """A loss that raises two calls deep in the user's own code."""

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 1)

    def load_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(4, 2), torch.ones(4, 1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _inner_helper(model, batch)


def _inner_helper(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    raise ValueError("the loss went wrong")


def test_user_code_that_raises_is_named_at_its_own_line_and_v_prints_its_traceback(tmp_path: Path) -> None:
    import inspect

    line = inspect.getsourcelines(_inner_helper)[1] + 1
    job = write(tmp_path, f"name: r\ntask: {{name: '{__name__}:Raising'}}\nclients: {{total: 2}}\nrounds: 1\n"
                          "evaluate: {server: false}\n")
    state = ["--state-dir", str(tmp_path / "state")]
    quiet = CliRunner().invoke(app, ["run", job, *state])
    assert quiet.exit_code == 1
    assert f"test_cli_spec_checks.py:{line} in _inner_helper: ValueError: the loss went wrong" in \
        quiet.output.replace("\n", " ").replace("  ", " ")
    assert "Traceback" not in quiet.output
    loud = CliRunner().invoke(app, ["run", job, *state, "-v"])
    assert "Traceback (most recent call last)" in loud.output
    assert 'raise ValueError("the loss went wrong")' in loud.output


class Open(BaseModel):
    model_config = {"extra": "allow"}  # asks for keys it does not declare

    width: int = 1


class OpenOptions(fedmq.Task):
    Options = Open


def test_options_that_ask_for_extra_keys_keep_them_and_fedmq_run_of_a_dict_says_what_is_wrong(
    tmp_path: Path
) -> None:
    from fedmq.common.errors import ConfigError

    assert OpenOptions(width=2, anything=3).options.model_extra == {"anything": 3}
    with pytest.raises(ConfigError, match="rouds: unknown key; did you mean 'rounds'"):
        fedmq.run({"name": "j", "task": "digits", "clients": {"total": 2}, "rouds": 1}, state_dir=tmp_path)
