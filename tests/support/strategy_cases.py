"""Every built-in strategy as it runs on the digits example: the cases the strategy tests and the
benchmarks page's accuracy table share. Adding a built-in strategy adds one line here.

Each case is the `strategy:` section of examples/digits.yaml for that strategy, with options
chosen for digits (10 clients, all of them each round).
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg"},
    "average": {"name": "average"},
    "fedavgm": {"name": "fedavgm", "options": {"server_lr": 1.0, "server_momentum": 0.9}},
    "weighted": {"name": "weighted", "options": {"weights": [2.0] + [1.0] * 9}},
    "moving_average": {"name": "moving_average", "options": {"momentum": 0.5}},
    "fedprox": {"name": "fedprox", "options": {"mu": 0.01}},
    "scaffold": {"name": "scaffold", "options": {"eta_g": 1.0}},
    "fedadagrad": {"name": "fedadagrad", "options": {"eta": 0.1, "beta1": 0.9, "tau": 1e-3}},
    "fedadam": {"name": "fedadam", "options": {"eta": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}},
    "fedyogi": {"name": "fedyogi", "options": {"eta": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}},
    "dp_fedavg": {"name": "dp_fedavg", "options": {"clip_norm": 1.0, "noise_multiplier": 0.05}},
    "dp_fedavg_adaptive": {"name": "dp_fedavg_adaptive", "options": {
        "clip_norm": 0.5, "noise_multiplier": 0.05, "count_noise_std": 0.5,
        "target_quantile": 0.5, "clip_learning_rate": 0.2}},
    "clipped": {"name": "clipped", "options": {"inner": {"name": "fedavg"}, "max_norm": 0.5}},
    # Robust rules set as in the poisoning test, for 3 poisoned clients of 10 (Bulyan: at most
    # f=1, as 10 >= 4f + 3): the table shows what that robustness costs on label-skewed digits.
    "median": {"name": "median"},
    "trimmed_mean": {"name": "trimmed_mean", "options": {"beta": 0.3}},
    "krum": {"name": "krum", "options": {"f": 3}},
    "multi_krum": {"name": "multi_krum", "options": {"f": 3}},
    "bulyan": {"name": "bulyan", "options": {"f": 1}},
}

# Rounds of these cases must keep at least this many clients (Krum's k > 2f + 2 with f = 3): the
# quorum examples/digits.yaml sets (min_fit 8) is raised to it, or the job is refused.
MIN_FIT: dict[str, int] = {"krum": 9, "multi_krum": 9}
