"""Workloads: what a job trains on and with.

- `datasets`: `load_dataset(spec, seed) -> Dataset` (numpy arrays, cached per process)
- `partition`: `partition(labels, num_clients, spec, seed)` and `label_skew`
- `models`: `build_model(spec, input_shape, num_classes, seed) -> nn.Module`
- `plugins`: `load_entrypoint(ref)` and the contracts user plug-ins meet

Nothing is re-exported here so that importing `partition` never pulls in torch.
"""
