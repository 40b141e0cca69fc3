"""Helpers the tests share that are not fixtures: the FedAvg simulation harness."""
