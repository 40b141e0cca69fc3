"""fedmq from Python: define a job, run it here (or on a cluster), follow it, get models back.

    python -m examples.python_api                     # in this process, no broker
    FEDMQ_BROKER_PASSWORD_FILE=cli.password python -m examples.python_api amqp://cli@127.0.0.1:5672/fedmq
                                                      # on a cluster: the password never on the command line

The same fields and validation as a YAML spec; a typo raises fedmq's ConfigError naming it.
"""

import sys

import torch

import fedmq
import fedmq.tasks.digits


class Progress(fedmq.Callback):
    def on_round_end(self, round: int, record: fedmq.RoundRecord) -> None:
        shown = {
            f"{s}.{k}": round_to(v) for s, m in record.metrics.items() for k, v in m.items() if s != "train"
        }
        print(f"round {round:2d}: train loss {record.get('train.loss') or float('nan'):.4f} {shown or ''}")


def round_to(value: float) -> float:
    return float(f"{value:.4f}")


def main(broker: str | None = None) -> fedmq.Result:
    job = fedmq.Job.model_validate(
        {
            "name": "digits-api",
            "task": {"name": "digits", "options": {"model": {"name": "mlp", "hidden": [64]}}},
            "clients": {"total": 10, "per_round": 5},
            "rounds": 15,
            "train": {"epochs": 2, "lr": 0.05},
            "evaluate": {"every": 5, "federated": {"clients": 4}},
        }
    )
    result = fedmq.run(job, broker=broker, callbacks=[Progress()])
    print(f"{result.status}: best {result.best}")
    print("federated accuracy by round:", result.metric("federated.accuracy"))
    print("sync:", result.sync_stats)
    model = result.best_model()  # an nn.Module, the best round's weights, eval mode
    x, y = fedmq.tasks.digits.Digits().load_server_data(fedmq.DataContext(client=-1, num_clients=1, seed=0))
    with torch.no_grad():
        print(f"best model scores {(model(x).argmax(1) == y).float().mean():.4f} on the held-out digits")
    return result


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
