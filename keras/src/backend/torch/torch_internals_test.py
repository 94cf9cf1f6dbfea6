"""Private torch names appear in the two adapter modules alone (tests
aside)."""

import ast
import pathlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types

from keras.src import testing
from keras.src.backend.torch import torch_internals

ADAPTERS = ("torch_internals.py", "torch_runtime.py")
ROOT = pathlib.Path(__file__).resolve().parents[4]


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _torch_private_attributes():
    """The private attribute names of the torch objects the project
    handles: tensors, DTensors, meshes, process groups, placements."""
    owners = [
        torch,
        torch._C,
        torch.Tensor,
        DTensor,
        DeviceMesh,
        dist,
        dist.distributed_c10d,
        dist.ProcessGroup,
        torch.overrides,
        torch.autograd.Variable,
        placement_types,
        torch.ops,
        torch.ops.aten.mm.default,
    ]
    names = {n for owner in owners for n in dir(owner) if _private(n)}
    # Instance attributes dir() of the classes does not list.
    names |= {"_hash", "_threads", "_timeout", "_devices", "_world"}
    names |= {"_c10d_functional"}
    return names


def _dotted(node):
    """`a.b.c` of an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_torch_uses(source, private_attributes):
    """`(line, text)` of each private torch name `source` uses."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            names = [alias.name for alias in node.names]
            if parts[0] == "torch" and any(map(_private, parts + names)):
                uses.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(map(_private, parts)):
                    uses.append((node.lineno, alias.name))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            # aten's ops are named by torch's op registry, not Python.
            if _dotted(node.value) in ("torch.ops.aten", "aten"):
                continue
            if node.attr in private_attributes:
                uses.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in private_attributes:
                uses.append((node.lineno, repr(node.value)))
    return uses


def _modules():
    folders = [ROOT / "keras", ROOT / "keras_dtensor"]
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            # Tests may name torch's privates: some check torch's own
            # behaviour (compile caches, autograd hooks) that Keras meets.
            if path.name.endswith("_test.py") or path.name in ADAPTERS:
                continue
            yield path


class TorchInternalsTest(testing.TestCase):
    def test_no_module_but_the_adapters_names_private_torch_apis(self):
        private_attributes = _torch_private_attributes()
        found = {}
        for path in _modules():
            uses = private_torch_uses(path.read_text(), private_attributes)
            if uses:
                found[str(path.relative_to(ROOT))] = uses
        self.assertEqual(found, {})

    def test_the_check_sees_each_kind_of_private_use(self):
        source = (
            "from torch.distributed.tensor._op_schema import OpSchema\n"
            "from torch.distributed.tensor.placement_types import "
            "_StridedShard\n"
            "import torch._dynamo\n"
            "x._local_tensor\n"
            "torch._C._will_engine_execute_node(node)\n"
            "state.pop('_hash')\n"
            "torch.ops.aten._unsafe_view.default\n"
            "layer._layers\n"
        )
        uses = private_torch_uses(source, _torch_private_attributes())
        self.assertEqual(
            sorted(line for line, _ in uses), [1, 2, 3, 4, 5, 5, 6]
        )

    def test_adapters_reach_what_they_name(self):
        self.assertIs(
            torch_internals.StridedShard, placement_types._StridedShard
        )
        value = torch.ones(2)
        self.assertIsNone(getattr(value, "_spec", None))
        self.assertEqual(
            torch_internals.op_schema(torch.ops.aten.mm.default)
            .returns[0]
            .type,
            torch.ops.aten.mm.default._schema.returns[0].type,
        )
