"""Update compression on the digits job: bytes per codec against float32, reconstruction error, accuracy.

Run from the repo root: ``.venv/bin/python benchmarks/compression.py [--rounds N] [--no-training]``.
Prints one JSON object with two parts, each codec compared with codec ``none`` in the same run:

``one_round``: the update delta (trained weights minus global weights) of client 0 after its
first round of local training on ``examples/digits.yaml``, through the Task runtime as a learner
trains. Per codec: tensor data bytes, wire bytes (msgpack of the tensors and the metadata, as
the tensor codec frames them), ``ratio`` (float32's wire bytes over the codec's) and the
reconstruction error (relative L2, and max |error| over max |delta|).

``training``: FedAvg on the same job in one process (the maths of tests/support/simulate.py),
every client's delta encoded and decoded with the codec, top-k carrying each client's residual
from round to round in its ``residual`` dtype (``_bf16``, ``_f16``, ``_int8`` labels; ``_noef``:
no error feedback): bytes per round of the encoded deltas summed over the clients, the ratio
against ``none``, ``state_bytes_per_round`` (the residuals' tensor bytes, which the services
carry too), and the server accuracy after the last round (``accuracy_drop_points`` is
``none``'s accuracy minus the codec's, in points). This is the compressed path's maths, not the
services.

``embedded``: the same job run by the services in one process (``fedmq run``, in-memory bus)
with the job's ``compression`` section set to each codec: ``update_bytes_per_round`` is the
round metric ``transport.update_bytes`` (the ClientUpdate bodies as the aggregator received
them, envelope included, so the real bytes a broker would carry), averaged over the rounds,
its ratio against ``none``, and the final server accuracy. topk's bodies also carry each
client's error-feedback residual back to the aggregator in its ``residual`` dtype (learners keep
no state): ``state_bytes_per_round`` (``transport.state_bytes``) is that part of them. With a
float32 residual (the model's size) topk sends more than ``none``. ``--no-embedded`` skips it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fedmq.common.codec import encode_state, packb  # noqa: E402
from fedmq.common.codec.compress import (  # noqa: E402
    CompressionSpec,
    decode,
    dequantize_residual,
    encode,
    encoded_nbytes,
    quantize_residual,
)
from fedmq.common.jobspec import JobSpec, load_job  # noqa: E402
from fedmq.common.seeding import torch_generator  # noqa: E402
from fedmq.common.task.contract import ClientData, EvalContext, TrainContext  # noqa: E402
from fedmq.common.task.runtime import TaskRuntime  # noqa: E402
from fedmq.services.aggregator.kernels import weighted_mean  # noqa: E402
from fedmq.services.scheduler.sampling import sample_clients  # noqa: E402
from tests.support.simulate import settings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
StateDict = dict[str, torch.Tensor]
SPECS = {
    "none": CompressionSpec(),
    "float16": CompressionSpec(codec="float16"),
    "bfloat16": CompressionSpec(codec="bfloat16"),
    "int8": CompressionSpec(codec="int8"),
    "topk_0.1": CompressionSpec(codec="topk", fraction=0.1),
    "topk_0.01": CompressionSpec(codec="topk", fraction=0.01),
}
RESIDUALS: dict[str, dict[str, Any]] = {"_bf16": {"residual": "bfloat16"}, "_f16": {"residual": "float16"},
             "_int8": {"residual": "int8"}, "_noef": {"error_feedback": False}}
RUNS = SPECS | {  # the codecs, then topk's residual settings
    label + suffix: CompressionSpec(codec="topk", fraction=spec.fraction, **change)
    for label, spec in SPECS.items() if spec.codec == "topk"
    for suffix, change in RESIDUALS.items()
}


class Federation:
    """The job's Task, its clients' data (loaded once) and a model to train them on."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.runtime = TaskRuntime.for_job(spec)
        self.model = self.runtime.build_model()
        self.initial = clone(self.model.state_dict())
        self.data: dict[int, ClientData] = {}
        self.server_data = self.runtime.load_server_data(None)

    def delta(self, global_weights: StateDict, client: int, server_round: int) -> tuple[StateDict, int]:
        """One client's round of local training from global_weights: its delta and example count."""
        if client not in self.data:
            self.data[client] = self.runtime.load_data(client, None)
        self.model.load_state_dict(global_weights)
        ctx = TrainContext(
            client=client,
            round=server_round,
            seed=self.spec.seed,
            train=settings(self.spec),
            device=CPU,
            generator=torch_generator(self.spec.seed, "train", server_round, client),
            global_weights=global_weights,
        )
        result = self.runtime.train(self.model, self.data[client], ctx)
        trained = self.model.state_dict()
        return {name: trained[name].detach() - global_weights[name] for name in trained}, result.num_examples

    def accuracy(self, weights: StateDict, server_round: int) -> float:
        self.model.load_state_dict(weights)
        ctx = EvalContext(round=server_round, seed=self.spec.seed, device=CPU)
        return float(self.runtime.evaluate(self.model, self.server_data, ctx).metrics["accuracy"])


def clone(state: dict[str, torch.Tensor]) -> StateDict:
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def wire_bytes(tensors: StateDict, meta: dict[str, Any]) -> int:
    """Bytes of the encoded tensors and metadata through fedmq's msgpack tensor codec."""
    return len(encode_state(tensors)) + len(packb(meta))


def one_round(fed: Federation) -> dict[str, Any]:
    delta, _ = fed.delta(fed.initial, client=0, server_round=1)
    flat = torch.cat([t.reshape(-1).double() for t in delta.values()])
    baseline = wire_bytes(delta, encode(delta, SPECS["none"]).meta)
    out: dict[str, Any] = {"params": flat.numel(), "delta_l2": float(flat.norm())}
    for label, spec in SPECS.items():
        encoded = encode(delta, spec)
        decoded = decode(encoded.tensors, encoded.meta, delta)
        error = torch.cat([(decoded[n].double() - delta[n].double()).reshape(-1) for n in delta])
        size = wire_bytes(encoded.tensors, encoded.meta)
        out[label] = {
            "data_bytes": encoded_nbytes(encoded.tensors),
            "wire_bytes": size,
            "ratio": round(baseline / size, 3),
            "relative_l2_error": float(error.norm() / flat.norm()),
            "max_error_over_max_delta": float(error.abs().max() / flat.abs().max()),
        }
    return out


def training(fed: Federation, spec: CompressionSpec, rounds: int) -> dict[str, Any]:
    """FedAvg with every client's delta through the codec; top-k keeps a residual per client."""
    job = fed.spec
    weights = clone(fed.initial)
    residuals: dict[int, StateDict | None] = {}
    round_bytes: list[int] = []
    state_bytes = 0
    started = time.process_time()
    for server_round in range(1, rounds + 1):
        decoded: list[tuple[StateDict, float]] = []
        sent = 0
        for client in sample_clients(job.seed, server_round, job.clients.total, job.clients.sampled):
            delta, examples = fed.delta(weights, client, server_round)
            encoded = encode(delta, spec, residuals.get(client))
            if encoded.residual is not None:  # what travels, and what the client gets back next round
                travelled = quantize_residual(encoded.residual, spec.residual)
                state_bytes += travelled.nbytes()
                residuals[client] = dequantize_residual(travelled, delta)
            sent += wire_bytes(encoded.tensors, encoded.meta)
            decoded.append((decode(encoded.tensors, encoded.meta, weights), float(examples)))
        step = weighted_mean(decoded)
        weights = {name: weights[name] + step[name] for name in weights}
        round_bytes.append(sent)
    return {
        "bytes_per_round": round(sum(round_bytes) / len(round_bytes)),
        "state_bytes_per_round": round(state_bytes / len(round_bytes)),
        "accuracy": fed.accuracy(weights, rounds),
        "cpu_seconds": round(time.process_time() - started, 2),
    }


def embedded(job: JobSpec, spec: CompressionSpec, rounds: int) -> dict[str, Any]:
    """The job through the services in one process with `spec`: its real update bytes per round."""
    import tempfile

    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.cli.embedded import run_job

    configure_logging("json", "warning")  # stdout carries the JSON report only
    with tempfile.TemporaryDirectory() as state:
        started = time.perf_counter()
        settings = Settings(state_dir=Path(state), log_level="warning", log_format="json")
        result = run_job(job.with_changes(rounds=rounds, compression=spec.model_dump()), settings,
                         idle_timeout=600)
        seconds = time.perf_counter() - started
    if result["status"] != "completed":
        raise SystemExit(f"embedded run with {spec} did not complete: {result.get('reason')}")
    transport = [h["metrics"]["transport"] for h in result["history"] if h["round"] > 0]
    sizes = [t["update_bytes"] for t in transport]
    return {
        "update_bytes_per_round": round(sum(sizes) / len(sizes)),
        "state_bytes_per_round": round(sum(t["state_bytes"] for t in transport) / len(transport)),
        "accuracy": result["final"]["server.accuracy"],
        "wall_seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(REPO / "examples" / "digits.yaml"))
    parser.add_argument("--rounds", type=int, default=None, help="training rounds (default: the job's)")
    parser.add_argument("--no-training", action="store_true", help="skip the in-process training figures")
    parser.add_argument("--no-embedded", action="store_true", help="skip the services' embedded runs")
    args = parser.parse_args()

    job = load_job(args.job)
    fed = Federation(job)
    report: dict[str, Any] = {"job": Path(args.job).name, "one_round": one_round(fed)}
    if not args.no_training:
        rounds = args.rounds or job.rounds
        runs = {label: training(fed, spec, rounds) for label, spec in RUNS.items()}
        base = runs["none"]
        for run in runs.values():
            run["ratio"] = round(base["bytes_per_round"] / run["bytes_per_round"], 3)
            run["accuracy_drop_points"] = round(100 * (base["accuracy"] - run["accuracy"]), 2)
        report["training"] = {"rounds": rounds, "clients_per_round": job.clients.sampled, **runs}
    if not args.no_embedded:
        rounds = args.rounds or job.rounds
        runs = {label: embedded(job, spec, rounds) for label, spec in RUNS.items()}
        base = runs["none"]
        for run in runs.values():
            run["ratio"] = round(base["update_bytes_per_round"] / run["update_bytes_per_round"], 3)
            run["accuracy_drop_points"] = round(100 * (base["accuracy"] - run["accuracy"]), 2)
        report["embedded"] = {"rounds": rounds, "clients_per_round": job.clients.sampled, **runs}
    report["versions"] = {"python": platform.python_version(), "torch": torch.__version__}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
