"""The native Llama twin at a `keras_hub_step` preset: the keras-hub
cells' native anchor, measured in the same launch.

`build(mode, preset)` makes the benchmark's plain-torch Llama
(`torch_models`, the `llama` workload: embedding, RMSNorm, rotary causal
attention, SwiGLU MLP, an untied head) at the preset's sizes, with AdamW
as `keras_hub_step` compiles its models, and wraps it in `NativeModel`,
which `keras_hub_step.run_steps` times as it times a Keras model. Modes:
`none` (the whole model on each process, as Keras's run without a
distribution) and `mp` (`parallelize_module` with Megatron's column- and
row-parallel plan over every process, the twin's `tp`). The twin has no
grouped-query attention (its key and value heads are the query heads)
and no padding mask (causal only): it is the size's anchor, not the
same model.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_models
import workloads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

# The modes the twin has (its `none` and `tp`).
MODES = ("none", "mp")


def config_of(preset):
    """The `workloads.Config` of a `keras_hub_step` preset."""
    backbone = preset["backbone"]
    hidden = backbone["hidden_dim"]
    return workloads.Config(
        hidden=hidden,
        layers=backbone["num_layers"],
        batch=preset["batch"],
        seq=preset["seq"],
        heads=backbone["num_query_heads"],
        vocab=backbone["vocabulary_size"],
        ffn_multiple=backbone["intermediate_dim"] // hidden,
        optimizer="adamw",
        learning_rate=1e-3,
    )


def build(mode, preset, seed):
    """The twin under `mode`, from `seed` (the same weights in every
    mode and on every process)."""
    config = config_of(preset)
    torch.manual_seed(seed)
    module = torch_models.build_model("llama", config)
    if mode == "mp":
        mesh = init_device_mesh(
            "cpu", (1, dist.get_world_size()), mesh_dim_names=("batch", "model")
        )
        module = torch_models.parallelize(module, "tp", mesh)
    optimizer = torch.optim.AdamW(
        module.parameters(), 1e-3, weight_decay=0.01, eps=1e-7
    )
    return NativeModel(module, optimizer)


class _Held:
    """A tensor as `run_steps` reads a Keras variable (`.value`)."""

    def __init__(self, value):
        self.value = value


class NativeModel:
    """The twin with the parts of a Keras model `run_steps` uses."""

    def __init__(self, module, optimizer):
        self.module = module
        self.torch_optimizer = optimizer
        self.optimizer = self

    def train_on_batch(self, x, y, sample_weight=None):
        """One AdamW step on token ids `x["token_ids"]` and next tokens
        `y`, the loss weighted by `sample_weight` and divided by the
        number of tokens (Keras's "sum over batch size")."""
        tokens = torch.as_tensor(x["token_ids"], dtype=torch.long)
        targets = torch.as_tensor(y, dtype=torch.long)
        weights = torch.as_tensor(sample_weight, dtype=torch.float32)
        logits = self.module(tokens)
        losses = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            reduction="none",
        )
        loss = (losses * weights.reshape(-1)).sum() / losses.numel()
        self.torch_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.torch_optimizer.step()
        return float(loss.detach())

    @property
    def weights(self):
        return [_Held(p) for p in self.module.parameters()]

    @property
    def variables(self):
        """The optimizer's state (read as `model.optimizer.variables`)."""
        return [
            _Held(t) for t in torch_models.optimizer_state(self.torch_optimizer)
        ]

    def get_weights(self):
        """Every parameter whole (a collective for each split one, on
        every process alike)."""
        return [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy()
            for p in self.module.parameters()
        ]
