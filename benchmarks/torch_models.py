"""The benchmark workloads as plain PyTorch modules, and their parallelism.

Each module computes exactly what its Keras twin in `keras_models.py`
computes (same layers, same attention math, same initial weights when
copied with `copy_keras_weights`), so the step-time ratio between them
isolates the cost of Keras and of its distribution.

Parallelism uses PyTorch's own tools: `DistributedDataParallel`,
`parallelize_module` with `ColwiseParallel`/`RowwiseParallel`, FSDP2's
`fully_shard`, and TP + DDP for the 2-D mesh.
"""

import torch
import torch.nn.functional as F
from keras_models import causal_bias
from keras_models import rotary_tables
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

COLWISE = ("q", "k", "v", "up", "gate")
ROWWISE = ("o", "down")


class Attention(nn.Module):
    """Multi-head self-attention with explicit matmul and softmax.

    Works on local shards under tensor parallelism: the number of heads is
    read from the width of the local query projection.
    """

    def __init__(self, config, bias=True, causal=False, rotary=False):
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.q = nn.Linear(h, h, bias=bias)
        self.k = nn.Linear(h, h, bias=bias)
        self.v = nn.Linear(h, h, bias=bias)
        self.o = nn.Linear(h, h, bias=bias)
        self.causal = causal
        self.rotary = rotary
        if causal:
            self.register_buffer("mask", torch.tensor(causal_bias(config.seq)))
        if rotary:
            cos, sin = rotary_tables(config.seq, config.head_dim)
            self.register_buffer("cos", torch.tensor(cos)[:, None, :])
            self.register_buffer("sin", torch.tensor(sin)[:, None, :])

    def _rope(self, x):
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (
            t.reshape(batch, seq, -1, self.head_dim)
            for t in (self.q(x), self.k(x), self.v(x))
        )
        if self.rotary:
            q, k = self._rope(q), self._rope(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(2, 3) * (1.0 / self.head_dim**0.5)
        if self.causal:
            scores = scores + self.mask
        out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o(out)


class MLPBlock(nn.Module):
    """`x + down(relu(up(x)))`."""

    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x):
        return x + self.down(F.relu(self.up(x)))


class TransformerBlock(nn.Module):
    """Pre-norm attention then GELU MLP, both residual."""

    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=1e-5)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden, eps=1e-5)
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LlamaBlock(nn.Module):
    """RMSNorm, causal RoPE attention, RMSNorm, SwiGLU MLP; no biases."""

    def __init__(self, config):
        super().__init__()
        h, f = config.hidden, config.ffn
        self.norm1 = nn.RMSNorm(h, eps=1e-6)
        self.attn = Attention(config, bias=False, causal=True, rotary=True)
        self.norm2 = nn.RMSNorm(h, eps=1e-6)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Model(nn.Module):
    """Optional embedding, a stack of blocks, optional norm, a head."""

    def __init__(self, blocks, head, embed=None, final_norm=None):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.head = head

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.head(x)


def build_model(workload, config):
    """Builds the native twin of `keras_models.build_model(workload)`."""
    n = config.layers
    if workload == "mlp":
        blocks = [MLPBlock(config) for _ in range(n)]
        return Model(blocks, nn.Linear(config.hidden, config.vocab))
    if workload == "transformer":
        blocks = [TransformerBlock(config) for _ in range(n)]
        return Model(blocks, nn.Linear(config.hidden, config.vocab))
    if workload == "llama":
        return Model(
            [LlamaBlock(config) for _ in range(n)],
            nn.Linear(config.hidden, config.vocab, bias=False),
            embed=nn.Embedding(config.vocab, config.hidden),
            final_norm=nn.RMSNorm(config.hidden, eps=1e-6),
        )
    raise ValueError(f"Unknown workload {workload!r}.")


def make_optimizer(config, parameters):
    """The torch optimizer matching `keras_models.make_optimizer`.

    DTensor parameters (those `parallelize_module` sharded) and plain ones
    (the rest of a tensor-parallel model) go in separate parameter groups:
    on CUDA, torch's optimizers default to their `foreach` kernels, which
    take a group's tensors in one call and refuse to mix DTensors with
    plain tensors.
    """
    parameters = _groups_by_tensor_type(parameters)
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameters, config.learning_rate, momentum=0.9)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            parameters, config.learning_rate, weight_decay=0.01, eps=1e-8
        )
    raise ValueError(f"Unknown optimizer {config.optimizer!r}.")


def _groups_by_tensor_type(parameters):
    """Parameter groups: the DTensors, then the plain tensors (if any)."""
    parameters = list(parameters)
    groups = [
        [p for p in parameters if isinstance(p, DTensor)],
        [p for p in parameters if not isinstance(p, DTensor)],
    ]
    return [{"params": group} for group in groups if group]


def _native_parameter(model, keras_path):
    """Maps a Keras variable path to `(native parameter, transpose)`."""
    layer, name = keras_path.split("/")
    block, _, sub = layer.partition("_")
    if block[:1] == "b" and block[1:].isdigit():
        module = model.blocks[int(block[1:])]
        if sub in ("q", "k", "v", "o"):
            module = module.attn
        module = getattr(module, sub)
    else:
        module = getattr(model, layer)
    attribute = "bias" if name in ("bias", "beta") else "weight"
    return getattr(module, attribute), name == "kernel"


def copy_keras_weights(keras_model, model):
    """Copies a Keras model's trainable weights into its native twin.

    Must run on every process (gathering a sharded variable is a
    collective), before the native model is parallelized.
    """
    with torch.no_grad():
        for variable in keras_model.trainable_variables:
            parameter, transpose = _native_parameter(model, variable.path)
            value = torch.as_tensor(variable.numpy())
            parameter.copy_(value.T if transpose else value)


def tensor_parallel_plan(model):
    """`parallelize_module` plan: Megatron colwise/rowwise per block."""
    plan = {}
    for i, block in enumerate(model.blocks):
        for name, module in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in COLWISE:
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            elif leaf in ROWWISE:
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def parallelize(model, mode, mesh):
    """Applies PyTorch's native parallelism for `mode` to `model`.

    Args:
        model: a module from `build_model`, on its device.
        mode: `"single"` (unchanged), `"dp"` (DDP), `"tp"`
            (`parallelize_module` on the `model` mesh axis), `"2d"` (TP on
            `model`, then DDP over `batch`) or `"fsdp"` (FSDP2
            `fully_shard` per block, then the root).
        mesh: the torch `DeviceMesh` of the Keras distribution (unused for
            `"single"` and `"dp"`).

    Returns:
        The module to train.
    """
    if mode == "single":
        return model
    if mode == "dp":
        return DistributedDataParallel(model)
    if mode == "tp":
        return parallelize_module(
            model, mesh["model"], tensor_parallel_plan(model)
        )
    if mode == "2d":
        from torch.distributed.tensor.parallel.ddp import (
            _pre_dp_module_transform,
        )

        parallelize_module(model, mesh["model"], tensor_parallel_plan(model))
        _pre_dp_module_transform(model)
        return DistributedDataParallel(
            model, process_group=mesh["batch"].get_group()
        )
    if mode == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(f"Unknown mode {mode!r}.")


def ddp_bucket_bytes(model):
    """Bytes of the gradient buckets `DistributedDataParallel` keeps.

    Without `gradient_as_bucket_view`, DDP's reducer holds a flat buffer
    per bucket, alongside the gradients, for the life of the module; DDP
    reports their sizes in its logging data. 0 for a module that is not
    DDP, or whose gradients are views of the buckets (counted with them).
    """
    if not isinstance(model, DistributedDataParallel):
        return 0
    if model.gradient_as_bucket_view:
        return 0
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


def loss_fn(logits, y):
    """Mean cross-entropy over every sample (and token)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def optimizer_state(optimizer):
    """The optimizer's state tensors (momentum, moments, step counters)."""
    tensors = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if torch.is_tensor(v))
    return tensors
