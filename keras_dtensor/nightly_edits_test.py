"""Tests of the edits for keras-nightly (`_nightly_edits.py`) and of
moved modules, each in a fresh interpreter."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_moved_module_is_served_under_its_old_name(tmp_path, monkeypatch):
    """Where the installed package lacks a module the overlay imports, the
    mount serves the module it moved to, with the old name's edits."""
    from keras_dtensor import _finder

    package = tmp_path / "movedpkg"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "core.py").write_text("VALUE = 7\n")
    (package / "kept.py").write_text("VALUE = 1\n")
    # A top-level module of the old name's last part is not the old module.
    (tmp_path / "core.py").write_text("VALUE = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        _finder,
        "MOVED_MODULES",
        {"movedpkg.core": "movedpkg.ops.core", "movedpkg.kept": "movedpkg.x"},
    )
    edited = []
    finder = _finder.KerasOverlayFinder(
        None, {"movedpkg.core": lambda: [edited.append]}
    )
    # This finder stands in for the installed one.
    others = [f for f in sys.meta_path if type(f) is not type(finder)]
    monkeypatch.setattr(sys, "meta_path", [finder, *others])
    for name in list(sys.modules):
        if name.startswith("movedpkg"):
            monkeypatch.delitem(sys.modules, name)
    import movedpkg.core
    import movedpkg.kept
    import movedpkg.ops.core

    # The edits ran when the moved module executed, once.
    assert movedpkg.core is movedpkg.ops.core
    assert movedpkg.core.VALUE == 7
    assert edited == [movedpkg.ops.core]
    # A module the package still has is its own, moved or not.
    assert movedpkg.kept.VALUE == 1
    assert movedpkg.kept.__name__ == "movedpkg.kept"


def test_renamed_names_get_their_old_names_back():
    import types

    from keras_dtensor import _nightly_edits

    trainer = types.ModuleType("keras.src.backend.torch.trainer")
    renamed = type("Trainer", (), {})
    trainer.Trainer = renamed
    _nightly_edits.edit_renamed_names(trainer)
    assert trainer.TorchTrainer is renamed
    # A module that has the old name keeps it.
    both = types.ModuleType("keras.src.trainers.trainer")
    both.Trainer, both.BaseTrainer = object, int
    _nightly_edits.edit_renamed_names(both)
    assert both.Trainer is object


def test_renamed_methods_get_their_old_names_back():
    import types

    from keras_dtensor import _nightly_edits

    trainer = types.ModuleType("keras.src.backend.torch.trainer")

    class Trainer:
        def _use_torch_compile(self):
            return "compiled?"

    trainer.Trainer = Trainer
    _nightly_edits.edit_renamed_names(trainer)
    assert trainer.TorchTrainer is Trainer
    assert Trainer()._should_torch_compile() == "compiled?"


def test_later_keras_ddp_and_variable_paths_are_replaced(monkeypatch):
    """A later keras's own DDP wrapping and Variable distribution give way
    to this project's under a distribution; keras 3.15.1 has neither, and
    the edits leave its classes as they are."""
    import types

    import numpy as np

    import keras
    from keras.src.distribution import distribution_lib as keras_distribution
    from keras_dtensor import _nightly_edits

    built = []

    class BaseTrainer:
        def get_metrics_result(self):
            return "global"

    class Trainer(BaseTrainer):
        variables = ()

        def _initialize_ddp(self):
            built.append("ddp")

        def get_metrics_result(self):
            return "reduced over processes"

    class Variable:
        def _initialize_distributed(self, initializer):
            return "upstream's"

    trainer = types.ModuleType("trainer")
    trainer.TorchTrainer = Trainer
    core = types.ModuleType("core")
    core.Variable = Variable
    _nightly_edits.edit_trainer_skips_ddp_under_distribution(trainer)
    _nightly_edits.edit_trainer_metrics_not_reduced_under_distribution(trainer)
    _nightly_edits.edit_variable_skips_upstream_distribution(core)
    assert Variable()._initialize_distributed(None) is None
    monkeypatch.setattr(keras_distribution, "distribution", lambda: None)
    Trainer()._initialize_ddp()
    assert built == ["ddp"]
    assert Trainer().get_metrics_result() == "reduced over processes"
    monkeypatch.setattr(keras_distribution, "distribution", lambda: object())
    Trainer()._initialize_ddp()
    assert built == ["ddp"]
    assert Trainer().get_metrics_result() == "global"
    # Nor for a model whose variables are DTensors, without a distribution.
    monkeypatch.setattr(keras_distribution, "distribution", lambda: None)
    distributed = Trainer()
    with keras_distribution.DataParallel(devices=["cpu:0"]).scope():
        distributed.variables = [keras.Variable(np.ones(2))]
    distributed._initialize_ddp()
    assert built == ["ddp"]
    # Keras 3.15.1's classes have no such methods: nothing is added.
    plain = types.ModuleType("plain")
    plain.TorchTrainer = type("TorchTrainer", (), {})
    plain.Variable = type("Variable", (), {})
    _nightly_edits.edit_trainer_skips_ddp_under_distribution(plain)
    _nightly_edits.edit_trainer_metrics_not_reduced_under_distribution(plain)
    _nightly_edits.edit_variable_skips_upstream_distribution(plain)
    assert not hasattr(plain.TorchTrainer, "_initialize_ddp")
    assert "get_metrics_result" not in vars(plain.TorchTrainer)
    assert not hasattr(plain.Variable, "_initialize_distributed")


def test_adapters_are_created_without_auto_sharding():
    """Every process iterates the global batches: an adapter is created as
    without auto-sharding (a later keras's adapters would split the data
    between processes themselves), and the distribution is restored."""
    import types

    from keras.src.distribution import distribution_lib as api
    from keras_dtensor import _step_edits

    seen = []

    def get_data_adapter(x):
        current = api.distribution()
        seen.append((current._is_multi_process, current.auto_shard_dataset))
        return "adapter"

    module = types.ModuleType("data_adapters")
    module.get_data_adapter = get_data_adapter
    module.is_tf_dataset = lambda x: False
    _step_edits.edit_data_adapter_auto_shard(module)
    mesh = api.DeviceMesh((1,), ("batch",), ["cpu:0"])
    distribution = api.DataParallel(device_mesh=mesh)
    distribution._is_multi_process = True
    api.set_distribution(distribution)
    try:
        assert module.get_data_adapter([1.0]) == "adapter"
    finally:
        api.set_distribution(None)
    assert seen == [(False, False)]
    assert distribution._is_multi_process is True
    assert distribution.auto_shard_dataset is True


def test_later_keras_batches_stay_global(monkeypatch):
    """Under a distribution, a later keras's own batch distribution and
    per-process predictions give way to the distributed step's; without
    one, upstream's run as written."""
    import types

    import numpy as np
    import torch

    from keras.src.distribution import distribution_lib as keras_distribution
    from keras_dtensor import _nightly_edits

    trainer = types.ModuleType("trainer")
    trainer._distribute_data = lambda data, layouts=None: ("upstream", data)
    trainer._gather_non_batch_axes = lambda data: ("own rows", data)
    _nightly_edits.edit_trainer_batches_stay_global(trainer)
    monkeypatch.setattr(keras_distribution, "distribution", lambda: None)
    assert trainer._distribute_data(1) == ("upstream", 1)
    monkeypatch.setattr(keras_distribution, "distribution", lambda: object())
    x, _ = trainer._distribute_data((np.ones((2, 3)), None))
    assert isinstance(x, torch.Tensor) and x.shape == (2, 3)
    assert trainer._gather_non_batch_axes("outputs") == "outputs"
    # Keras 3.15.1's trainer module has neither function.
    plain = types.ModuleType("plain")
    _nightly_edits.edit_trainer_batches_stay_global(plain)
    assert not hasattr(plain, "_distribute_data")
    assert not hasattr(plain, "_gather_non_batch_axes")


def test_later_keras_epoch_iterator_keeps_the_dataloader(monkeypatch):
    """Under a distribution, a later keras's numpy iteration of a
    `ModelParallel`'s data gives way to the torch `DataLoader`; without
    one, and on keras 3.15.1's iterator, upstream's runs."""
    import types

    from keras.src.distribution import distribution_lib as keras_distribution
    from keras_dtensor import _nightly_edits

    class Adapter:
        def get_torch_dataloader(self):
            return "dataloader"

    class TorchEpochIterator:
        data_adapter = Adapter()

        def _get_iterator(self):
            return "numpy iterator"

        def _get_distributed_iterator(self, distribution):
            return "numpy iterator"

    trainer = types.ModuleType("trainer")
    trainer.TorchEpochIterator = TorchEpochIterator
    _nightly_edits.edit_epoch_iterator_keeps_torch_dataloader(trainer)
    monkeypatch.setattr(keras_distribution, "distribution", lambda: None)
    assert TorchEpochIterator()._get_iterator() == "numpy iterator"
    monkeypatch.setattr(keras_distribution, "distribution", lambda: object())
    assert TorchEpochIterator()._get_iterator() == "dataloader"
    # Keras 3.15.1's iterator has no distributed path: it is kept.
    plain = types.ModuleType("plain")
    plain.TorchEpochIterator = type(
        "TorchEpochIterator", (), {"_get_iterator": lambda self: "upstream"}
    )
    upstream = plain.TorchEpochIterator._get_iterator
    _nightly_edits.edit_epoch_iterator_keeps_torch_dataloader(plain)
    assert plain.TorchEpochIterator._get_iterator is upstream


def test_later_keras_ddp_without_distribution_is_upstreams(monkeypatch):
    """Without a distribution a later keras's DDP wrapping is built, as
    upstream builds it, unless `KERAS_DTENSOR_NO_DDP=1`; under one, never."""
    import types

    from keras.src.distribution import distribution_lib as keras_distribution
    from keras_dtensor import _nightly_edits

    built = []

    class Trainer:
        variables = ()

        def _initialize_ddp(self):
            built.append("ddp")

    trainer = types.ModuleType("trainer")
    trainer.TorchTrainer = Trainer
    _nightly_edits.edit_trainer_skips_ddp_under_distribution(trainer)
    _nightly_edits.edit_trainer_no_ddp_without_distribution(trainer)
    for no_ddp in (None, "1"):
        if no_ddp is None:
            monkeypatch.delenv(_nightly_edits.NO_DDP_ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(_nightly_edits.NO_DDP_ENV_VAR, no_ddp)
        for distribution in (None, object()):
            monkeypatch.setattr(
                keras_distribution, "distribution", lambda d=distribution: d
            )
            Trainer()._initialize_ddp()
    assert built == ["ddp"]
    plain = types.ModuleType("plain")
    plain.TorchTrainer = type("TorchTrainer", (), {})
    _nightly_edits.edit_trainer_no_ddp_without_distribution(plain)
    assert not hasattr(plain.TorchTrainer, "_initialize_ddp")


def test_later_keras_compiles_under_every_distribution(monkeypatch):
    """Under a distribution, `jit_compile=True` compiles the step whatever
    the distribution (a later keras refuses all but `DataParallel`);
    without one, upstream's rule holds; keras 3.15.1 is left as it is."""
    import types

    from keras.src.distribution import distribution_lib as keras_distribution
    from keras_dtensor import _nightly_edits

    class Trainer:
        jit_compile = True
        run_eagerly = False

        def _use_torch_compile(self):
            return "upstream's rule"

    trainer = types.ModuleType("keras.src.backend.torch.trainer")
    trainer.Trainer = Trainer
    _nightly_edits.edit_renamed_names(trainer)
    _nightly_edits.edit_trainer_compiles_under_every_distribution(trainer)
    monkeypatch.setattr(keras_distribution, "distribution", lambda: None)
    assert Trainer()._should_torch_compile() == "upstream's rule"
    monkeypatch.setattr(keras_distribution, "distribution", lambda: object())
    assert Trainer()._use_torch_compile() is True
    assert Trainer()._should_torch_compile() is True
    eager = Trainer()
    eager.run_eagerly = True
    assert eager._should_torch_compile() is False
    # Keras 3.15.1's trainer has `_should_torch_compile` only: kept.
    plain = types.ModuleType("plain")
    plain.TorchTrainer = type(
        "TorchTrainer", (), {"_should_torch_compile": lambda self: "3.15.1"}
    )
    _nightly_edits.edit_trainer_compiles_under_every_distribution(plain)
    assert plain.TorchTrainer()._should_torch_compile() == "3.15.1"
    assert not hasattr(plain.TorchTrainer, "_use_torch_compile")


def test_later_keras_attention_gets_inputs_laid_out():
    """A later keras's `dot_product_attention` receives DTensor inputs in
    the placements of `_attention_placements`; plain tensors as given."""
    import types

    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    import keras
    from keras_dtensor import _nightly_edits

    calls = []

    def dot_product_attention(query, key, value, bias=None, mask=None, **kw):
        calls.append((query, key, value, bias, mask, kw))
        return "attention"

    nn = types.ModuleType("nn")
    nn.dot_product_attention = dot_product_attention
    _nightly_edits.edit_attention_inputs_fit_local_shards(nn)
    plain = torch.ones((2, 3, 2, 4))
    assert nn.dot_product_attention(plain, plain, plain, scale=0.5) == (
        "attention"
    )
    assert calls[-1][0] is plain and calls[-1][5] == {"scale": 0.5}
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    mesh = distribution.device_mesh.backend_mesh
    query = distribute_tensor(torch.ones((2, 3, 4, 4)), mesh, [Shard(2)])
    key = distribute_tensor(torch.ones((2, 3, 2, 4)), mesh, [Shard(1)])
    mask = np.ones((2, 1, 3, 3), "bool")
    nn.dot_product_attention(query, key, key, mask=mask)
    query, key, value, bias, mask, _ = calls[-1]
    assert query.placements == (Shard(2),)
    # Key and value repeated to the query's 4 heads, split alike.
    assert key.shape == value.shape == (2, 3, 4, 4)
    assert key.placements == value.placements == (Shard(2),)
    assert bias is None
    assert isinstance(mask, DTensor) and mask.placements == (Replicate(),)
