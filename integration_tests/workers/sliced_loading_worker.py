"""Loading Keras files under distributions reads each process's part only.

Usage: sliced_loading_worker.py WORK_DIR (on 4 processes)

1. Without a distribution, every rank builds the same model; rank 0 saves
   it as `.weights.h5`, `.keras` and Keras's sharded weights format
   (`max_shard_size`, several files), and a few arrays of uneven shapes.
2. Under each distribution of `LAYOUTS` (one axis of a (4,) mesh; several
   axes of a (2, 2) mesh, a dimension over two axes in both orders;
   `DataParallel`, replicated), a new model loads each file. Recorded:
   the values loaded (gathered), each variable's placements, the
   elements read from the files and the elements of the local tensors
   the file restored, and the bytes read from the `.keras` archive.
3. Uneven shapes (rows that DTensor splits as 2, 2, 1, 0): raw DTensor
   parameters assigned from the saved arrays, their local tensors
   against DTensor's own split of the full array.
4. Under the (2, 2) mesh, the model saves `.keras` and the sharded
   format (its sharded variables written as gathered, in chunks of a few
   rows); with the distribution unset, plain keras loads both.
5. A bfloat16 model saved under the (4,) mesh: its sharded variables
   written by chunks; plain keras reads the same bits back.
6. keras-hub (where installed): a tiny Gemma saved with `save_to_preset`
   loads with `from_preset` under its published layout map.

Sharded variables are created a few rows at a time (`CHUNK_BYTES`), so
that `load_model` and `from_preset` create them empty and never run
their initializers (`INITIALIZED` counts the shards filled).
"""

import json
import os
import sys

import numpy as np
import torch.distributed as dist
import worker_utils
from worker_utils import record

import keras
from keras.src.backend.torch import shard_reads
from keras.src.backend.torch import shard_writes
from keras.src.backend.torch import sharded_initialization
from keras.src.saving import dataset_views
from keras.src.saving import zip_members

SEED = 5
VOCABULARY = 1024
# Small enough that the sharded format holds the model in several files.
MAX_SHARD_GB = 300 * 1024 / 1024**3

# Name -> layouts by variable path pattern ("dp": DataParallel).
LAYOUTS = {
    "one_axis": (
        (4,),
        ("model",),
        {
            ".*embeddings": ("model", None),
            ".*kernel": (None, "model"),
            ".*bias": ("model",),
        },
    ),
    "several_axes": (
        (2, 2),
        ("batch", "model"),
        {
            ".*embeddings": (("batch", "model"), None),
            ".*hidden/kernel": ("batch", "model"),
            ".*output/kernel": (("model", "batch"), None),
            ".*bias": ("model",),
        },
    ),
    "dp": None,
}
UNEVEN = {"rows": ((5, 3), "one_axis"), "grid": ((3, 6), "several_axes")}

# Elements read from saved arrays, and bytes read from `.keras` members.
READ = {"elements": 0, "bytes": 0}


def count_reads():
    read_blocks = dataset_views.DatasetView.read_blocks
    getitem = dataset_views.DatasetView.__getitem__
    readinto = zip_members._MemberFile.readinto

    def counted_read_blocks(self, blocks):
        values = read_blocks(self, blocks)
        READ["elements"] += sum(v.size for v in values)
        return values

    def counted_getitem(self, selection):
        value = getitem(self, selection)
        READ["elements"] += np.asarray(value).size
        return value

    def counted_readinto(self, buffer):
        count = readinto(self, buffer)
        READ["bytes"] += count
        return count

    dataset_views.DatasetView.read_blocks = counted_read_blocks
    dataset_views.DatasetView.__getitem__ = counted_getitem
    zip_members._MemberFile.readinto = counted_readinto


# Shards filled by their initializers, chunk by chunk.
INITIALIZED = {"shards": 0}


def count_initialized():
    sharded_initialization.CHUNK_BYTES = 256
    fill_shard = sharded_initialization._fill_shard

    def counted_fill_shard(*args):
        INITIALIZED["shards"] += 1
        return fill_shard(*args)

    sharded_initialization._fill_shard = counted_fill_shard


def build_model(seed=SEED):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 64, name="embedding")(inputs)
    x = keras.layers.Dense(48, name="hidden")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    outputs = keras.layers.Dense(8, name="output")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def values(model):
    return [w.tolist() for w in model.get_weights()] + [
        np.asarray(v.numpy()).tolist() for v in model.optimizer.variables
    ]


def local_elements(model):
    variables = model.weights + model.optimizer.variables
    return sum(v.value.to_local().numel() for v in variables)


def placements(model):
    return {v.path: [str(p) for p in v.value.placements] for v in model.weights}


def set_distribution(name):
    if LAYOUTS[name] is None:
        devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        return
    shape, axes, layouts = LAYOUTS[name]
    mesh = keras.distribution.DeviceMesh(
        shape, axes, keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, layout in layouts.items():
        layout_map[path] = layout
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def write_reference(work):
    model = build_model()
    if worker_utils.rank() == 0:
        model.save_weights(os.path.join(work, "model.weights.h5"))
        model.save(os.path.join(work, "model.keras"))
        model.save_weights(
            os.path.join(work, "model.weights.json"),
            max_shard_size=MAX_SHARD_GB,
        )
        import h5py

        rng = np.random.default_rng(SEED)
        with h5py.File(os.path.join(work, "uneven.h5"), "w") as f:
            for name, (shape, _) in UNEVEN.items():
                f[name] = rng.standard_normal(shape).astype("float32")
    dist.barrier()
    record("reference", values(model))
    with open(os.path.join(work, "model.weights.json")) as f:
        record("reference/shard_files", sorted(set(_files(json.load(f)))))


def _files(index):
    for names in index["weight_map"].values():
        yield from names if isinstance(names, list) else [names]


def load_under(name, work):
    set_distribution(name)
    with worker_utils.prefixed(name):
        for kind, file_name in (
            ("h5", "model.weights.h5"),
            ("sharded", "model.weights.json"),
            ("keras_weights", "model.keras"),
        ):
            model = build_model(seed=SEED + 1)
            READ["elements"] = 0
            model.load_weights(os.path.join(work, file_name))
            record(f"{kind}/read", READ["elements"])
            record(f"{kind}/local", local_elements(model))
            record(f"{kind}/values", values(model))
        record("keras/created_initialized", INITIALIZED["shards"])
        READ["elements"] = READ["bytes"] = INITIALIZED["shards"] = 0
        model = keras.saving.load_model(os.path.join(work, "model.keras"))
        record("keras/initialized", INITIALIZED["shards"])
        record("keras/read", READ["elements"])
        record("keras/read_bytes", READ["bytes"])
        record("keras/local", local_elements(model))
        record("keras/values", values(model))
        record("placements", placements(model))


def load_uneven(work):
    import h5py
    import torch
    from torch.distributed.tensor import distribute_tensor

    with h5py.File(os.path.join(work, "uneven.h5"), "r") as f:
        for name, (shape, layout_name) in UNEVEN.items():
            set_distribution(layout_name)
            layout = keras.distribution.TensorLayout(
                ("model", None) if name == "rows" else ("batch", "model"),
                keras.distribution.distribution().device_mesh,
            ).backend_layout
            expected = distribute_tensor(
                torch.as_tensor(f[name][()]),
                layout.mesh,
                layout.placements,
                src_data_rank=None,
            )
            loaded = distribute_tensor(
                torch.zeros(shape),
                layout.mesh,
                layout.placements,
                src_data_rank=None,
            )
            shard_reads.assign_from_view(
                loaded, dataset_views.DatasetView(f[name]), "float32"
            )
            record(f"uneven/{name}/local", loaded.to_local().tolist())
            record(f"uneven/{name}/expected", expected.to_local().tolist())
            record(f"uneven/{name}/shape", list(loaded.shape))


def save_and_read_plainly(work):
    set_distribution("several_axes")
    model = build_model(seed=SEED + 2)
    # Chunks of a few rows: every sharded variable is sent in several.
    shard_writes.CHUNK_BYTES = 4096
    written = []
    write_by_chunks = shard_writes.write_by_chunks

    def counted(parameter, write):
        written.append(tuple(parameter.shape))
        return write_by_chunks(parameter, write)

    shard_writes.write_by_chunks = counted
    record("saved/values", values(model))
    directory = os.path.join(work, "saved")
    os.makedirs(directory, exist_ok=True)
    model.save(os.path.join(directory, "model.keras"))
    model.save_weights(
        os.path.join(directory, "model.weights.json"),
        max_shard_size=MAX_SHARD_GB,
    )
    record("saved/listing", sorted(os.listdir(directory)))
    record("saved/by_chunks", len(written))
    record(
        "saved/sharded_variables",
        sum(
            any(p.is_shard() for p in v.value.placements)
            for v in model.weights + model.optimizer.variables
        ),
    )
    keras.distribution.set_distribution(None)
    plain = keras.saving.load_model(os.path.join(directory, "model.keras"))
    record("saved/plain_keras", values(plain))
    plain = build_model(seed=SEED + 3)
    plain.load_weights(os.path.join(directory, "model.weights.json"))
    record("saved/plain_sharded", values(plain))


def bfloat16_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(
        VOCABULARY, 64, name="embedding", dtype="bfloat16"
    )(inputs)
    outputs = keras.layers.Dense(8, name="output", dtype="bfloat16")(x)
    return keras.Model(inputs, outputs)


def save_bfloat16(work):
    set_distribution("one_axis")
    model = bfloat16_model(SEED)
    written = []
    write_by_chunks = shard_writes.write_by_chunks

    def counted(parameter, write):
        written.append(str(parameter.dtype))
        return write_by_chunks(parameter, write)

    shard_writes.write_by_chunks = counted
    path = os.path.join(work, "saved", "bfloat16.weights.h5")
    model.save_weights(path)
    shard_writes.write_by_chunks = write_by_chunks
    record("bfloat16/by_chunks", written)
    record("bfloat16/values", _bits(model))
    keras.distribution.set_distribution(None)
    plain = bfloat16_model(SEED + 1)
    plain.load_weights(path)
    record("bfloat16/plain", _bits(plain))


def _bits(model):
    """Each weight's bfloat16 bits."""
    return [np.asarray(w).view("int16").tolist() for w in model.get_weights()]


def load_keras_hub_preset(work):
    try:
        import keras_hub
    except ImportError:
        record("keras_hub", None)
        return
    keras.distribution.set_distribution(None)
    config = dict(
        vocabulary_size=256,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=8,
    )
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.GemmaBackbone(**config)
    preset = os.path.join(work, "gemma_preset")
    if worker_utils.rank() == 0:
        backbone.save_to_preset(preset)
    dist.barrier()
    record("keras_hub/reference", [w.tolist() for w in backbone.get_weights()])
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    READ["elements"] = INITIALIZED["shards"] = 0
    loaded = keras_hub.models.GemmaBackbone.from_preset(preset)
    record("keras_hub/initialized", INITIALIZED["shards"])
    record("keras_hub/read", READ["elements"])
    record(
        "keras_hub/local",
        sum(v.value.to_local().numel() for v in loaded.weights),
    )
    record("keras_hub/values", [w.tolist() for w in loaded.get_weights()])
    record(
        "keras_hub/embedding_placements",
        [str(p) for p in loaded.token_embedding.embeddings.value.placements],
    )


def main():
    (work,) = sys.argv[1:]
    keras.distribution.initialize()
    count_reads()
    count_initialized()
    write_reference(work)
    for name in LAYOUTS:
        load_under(name, work)
    load_uneven(work)
    save_and_read_plainly(work)
    save_bfloat16(work)
    load_keras_hub_preset(work)
    worker_utils.report()


if __name__ == "__main__":
    main()
