"""The plan of a model's GGUF file, built once per model: its layout and everything read off it.

Every question about a model's file (which tensors, their shapes, which matrices an importance
matrix covers, the types a mix gives them) used to walk the model's layout again; a ``ModelPlan``
walks it once (``plan_of``) and answers them all. ``save_gguf``, the importance-matrix functions
(``mixle.gguf.imatrix_file``) and ``gguf_mix_types`` / ``gguf_mix_specs`` take a plan wherever
they take a model.
"""

from functools import cached_property

from mixle._optional import require
from mixle.gguf.layouts import layout_of
from mixle.gguf.mixes import tensor_types

__all__ = ["ModelPlan", "plan_of", "weight_shape", "full_shape", "part_shape", "float_weight"]


class ModelPlan:
    """A model's GGUF layout (``mixle.gguf.layouts.Layout``) and what is read off it, each once, on
    first use (so a plan costs nothing, and refuses nothing, until a question needs the layout).

    Attributes:
        model: the torch model.
        purpose: what an ImportError for a missing gguf-py names.
    """

    def __init__(self, model, purpose="save_gguf"):
        self.model, self.purpose = model, purpose

    @cached_property
    def gguf(self):
        """The gguf-py module (ImportError naming the pip extra if it is missing)."""
        return require("gguf", extra="gguf", purpose=self.purpose)

    @cached_property
    def layout(self):
        """The model's layout: the first of ``LAYOUTS`` that takes it (ValueError if none does)."""
        return layout_of(self.model, self.gguf)

    @cached_property
    def part_shapes(self):
        """``{gguf name: numpy-order shape}`` of every tensor written (an expert weight: its row slice)."""
        return {part.name: part_shape(part) for part in self.layout.parts}

    @cached_property
    def matrix_shapes(self):
        """``{gguf name: shape}`` of the weight matrices, as an importance matrix checks them (a split
        expert weight's rows as 0)."""
        shapes = {}
        for part in self.layout.parts:
            if part.module is not None:
                shape = full_shape(part) if part.experts else weight_shape(part.module)
                shapes[part.name] = shape if part.row_slice is None else shape[:-2] + (0,) + shape[-1:]
        return shapes

    @cached_property
    def imatrix_names(self):
        """``{model layer path: [gguf tensor names]}`` of the matrices an imatrix has entries for
        (``blk.*`` and ``output.weight``; a split fused weight gives one path two names)."""
        names = {}
        for part in self.layout.parts:
            # llama-imatrix collects products of blk.* weights and the head (with --process-output), not
            # the token embedding (a lookup; also the head of a tied model, whose product it skips)
            if part.module is not None and (part.name.startswith("blk.") or part.name == "output.weight"):
                names.setdefault(part.path, []).append(part.name)
        return names

    def mix_types(self, mix, imatrix=False):
        """``{gguf name: ggml type or None}`` llama.cpp's quantizer gives the tensors under ``mix``
        (a ``GGUFMix``; ``imatrix``: with an importance matrix, ``llama-quantize --imatrix``)."""
        hparams = dict(self.layout.hparams)
        return tensor_types(mix, self.part_shapes, self.layout.arch, hparams["add_block_count"],
                            n_head=hparams.get("add_head_count"), n_head_kv=hparams.get("add_head_count_kv"),
                            n_expert=hparams.get("add_expert_count", 0), imatrix=imatrix)


def plan_of(model, purpose="save_gguf"):
    """The ``ModelPlan`` of ``model`` (a plan is returned as it is).

    Nothing is read until a question needs it: ``plan.layout`` raises ValueError when no llama.cpp
    architecture takes the model, ImportError (naming the pip extra) when gguf-py is missing.

    >>> from mixle.models.transformer import build_causal_lm
    >>> plan = plan_of(build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8))
    >>> plan.layout.arch, plan.imatrix_names["blocks.0.qkv"]
    ('gpt2', ['blk.0.attn_qkv.weight'])
    """
    if isinstance(model, ModelPlan):
        return model
    return ModelPlan(model, purpose)


def weight_shape(module):
    """The ``(out, in)`` shape of a layer's weight (float, QAT or converted)."""
    return tuple(int(d) for d in (getattr(module, "weight_shape", None) or module.weight.shape))


def full_shape(part):
    """The shape of the whole weight a part takes its rows from (an expert weight's ``(E, rows, cols)``):
    a converted fused weight's ``array_shape``, else the layer's ``weight_shape``, else the weight's own."""
    found = getattr(part.module, part.attr, None)
    shape = getattr(found, "array_shape", None) or getattr(part.module, "weight_shape", None) or found.shape
    return tuple(int(d) for d in shape)


def part_shape(part):
    """The numpy-order shape of the tensor a part writes (an expert weight: its row slice)."""
    if part.module is None:
        return tuple(part.tensor.shape)
    shape = full_shape(part)
    if part.row_slice is not None:
        shape = (*shape[:-2], len(range(shape[-2])[part.row_slice]), shape[-1])
    return shape


def float_weight(part):
    """The float weight a part writes (an expert weight: its row slice), detached."""
    weight = getattr(part.module, part.attr).detach()
    return weight if part.row_slice is None else weight[..., part.row_slice, :]
