"""The step mode's handlers for in-place writes, extreme reductions and
Python values, on tensors split over 2 processes.

Inside `replicate_created_tensors` on a ("batch",) mesh of every process,
each check runs an op on DTensors split over the processes and records
the whole result and its placements; `step_handlers_test.py` compares them
with the same op on the full tensors in plain torch.
"""

import torch
import worker_utils
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from worker_utils import record

import keras
from keras.src.backend.torch import created_tensors


def full_values():
    """The full tensors every check starts from (the same on every rank)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(4, 3, 10, generator=generator),
        "rows": torch.arange(32, dtype=torch.float32).reshape(4, 8),
        "lengths": torch.tensor([5, 3, 7, 6]),
    }


def record_whole(key, value):
    record(f"{key}/placements", [str(p) for p in value.placements])
    record(f"{key}/values", value.full_tensor().tolist())


def split_inputs(mesh, full):
    """The DTensors the checks take, laid out outside the step's mode
    (inside it, tensors made from Python values are replicated)."""
    rows, lengths = full["rows"], full["lengths"]
    return {
        "split_rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "split_columns": distribute_tensor(rows, mesh, [Shard(1)]),
        "zeros": [
            distribute_tensor(torch.zeros(4, 8), mesh, [Replicate()])
            for _ in range(2)
        ],
        "row_target": distribute_tensor(rows.clone(), mesh, [Shard(0)]),
        "values": distribute_tensor(
            torch.tensor([10.0, 20.0, 30.0, 40.0]), mesh, [Shard(0)]
        ),
        "index": (torch.arange(4), torch.tensor([5, 1, -1, 0])),
        "logits": distribute_tensor(full["logits"], mesh, [Shard(2)]),
        "lengths": distribute_tensor(lengths, mesh, [Shard(0)]),
    }


def in_place_writes(split):
    target = split["zeros"][0]
    target.copy_(split["split_columns"])
    record_whole("copy", target)
    target = split["zeros"][1]
    target[:, 2:4] = split["split_rows"][:, :2]
    record_whole("set_item", target)
    target = split["row_target"]
    target.index_put_(split["index"], split["values"])
    record_whole("index_put", target)
    record("index_put/local_rows", target.to_local().shape[0])
    target.index_put_(split["index"], split["values"], accumulate=True)
    record_whole("index_put_accumulate", target)


def extreme_reductions(split):
    record_whole("argmax", torch.argmax(split["logits"], dim=-1))
    record_whole("min", torch.min(split["lengths"]))
    record_whole("amax", torch.amax(split["logits"], dim=-1))


def python_values(split):
    lengths = split["lengths"]
    record("int_of_min", int(torch.min(lengths)))
    record("item_of_sum", lengths.sum().item())
    record("bool_of_any", bool(torch.any(lengths > 6)))
    record("tolist", lengths.tolist())


def main():
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    keras_mesh = keras.distribution.DeviceMesh(
        (len(devices),), ("batch",), devices
    )
    split = split_inputs(keras_mesh.backend_mesh, full_values())
    with created_tensors.replicate_created_tensors(keras_mesh):
        in_place_writes(split)
        extreme_reductions(split)
        python_values(split)
    worker_utils.report()


if __name__ == "__main__":
    main()
