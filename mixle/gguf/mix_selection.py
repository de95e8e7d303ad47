"""``apply_qat(model, gguf_mix=...)``: a llama.cpp mix as layer patterns (``gguf_mix_specs``).

Each weight the mix quantizes gets an exact-path pattern with the grid of the block type
llama.cpp's quantizer gives it; weights it keeps float (F16/F32) get ``(path, None)``. An untied
token embedding the mix quantizes is opted in. ``mix_importance`` keeps the importance entries the
mix quantizes with. ``mixle.gguf.writer`` (and torch) is imported only when a mix is asked for.
"""

import re

__all__ = ["mix_selection", "mix_importance", "default_fields", "MIX_FIELDS"]

MIX_FIELDS = ("act_bits", "act_rounding")


def mix_selection(model, gguf_mix, spec, spec_fields, patterns, exclude, opt_in, importance=None):
    """``(patterns, opt_in)`` selecting every layer of ``model`` on its grid in ``gguf_mix``
    (with ``importance``: the types ``llama-quantize --imatrix`` gives, ``gguf_mix_specs``).

    ``act_bits`` (and ``act_rounding``) are the spec fields a mix takes (``MIX_FIELDS``): every layer's spec
    gets them, so that each product's input is rounded as llama.cpp's CPU path rounds it on that layer's block
    type (``Grid.activation_grid``: Q8_0 or Q8_K blocks); they change no stored weight.

    Raises:
        ValueError: ``gguf_mix`` together with a spec, other spec fields, patterns, exclude or opt_in:
            the mix decides every layer's grid, so they would change the file llama.cpp makes.
    """
    given = [name for name, value in (("spec", spec), ("patterns", patterns if tuple(patterns) != (".*",) else None),
                                      ("exclude", tuple(exclude) or None), ("opt_in", tuple(opt_in) or None))
             if value is not None] + sorted(set(spec_fields) - set(MIX_FIELDS))
    if given:
        raise ValueError(f"gguf_mix={gguf_mix!r} decides every layer's grid (the block type llama.cpp's quantizer "
                         f"gives it), so it cannot be combined with {given}: pass gguf_mix alone, or drop it and "
                         f"give patterns=[(path, QuantSpec(grid=...)), ...] yourself")
    from mixle.gguf.flax_twin import flax_specs, is_flax, torch_twin
    from mixle.gguf.plan import plan_of  # torch and gguf, only when a mix is asked for
    from mixle.gguf.writer import gguf_mix_specs

    flax_model = model if is_flax(model) else None
    if flax_model is not None:  # its transformers twin's types (mixle.gguf.flax_twin), by Flax path
        model = torch_twin(flax_model, "apply_qat(gguf_mix=...)")[0]
    plan = plan_of(model, "apply_qat(gguf_mix=...)")
    model = plan.model
    specs = gguf_mix_specs(plan, gguf_mix, importance=importance)
    act = {name: spec_fields[name] for name in MIX_FIELDS if spec_fields.get(name) is not None}
    if act:
        specs = {path: None if spec is None else spec.replace(**act) for path, spec in specs.items()}
    if flax_model is not None:
        return [(re.escape(path), spec) for path, spec in flax_specs(flax_model, specs).items()], ()
    modules = dict(model.named_modules())
    embedding = any(spec is not None and (type(modules[path]).__name__ == "Embedding"
                                          or type(modules[path]).__name__.endswith("ScaledWordEmbedding"))
                    for path, spec in specs.items())
    return [(re.escape(path), spec) for path, spec in specs.items()], ("embedding",) if embedding else ()


def default_fields(spec_fields):
    """The spec fields of a mix call's default spec: none of ``MIX_FIELDS``, which each layer's spec carries
    (the mix's patterns select every layer, so the default spec quantizes nothing).

    >>> default_fields({"act_bits": 8, "act_rounding": "x86"})
    {}
    """
    return {name: value for name, value in spec_fields.items() if name not in MIX_FIELDS}


def mix_importance(model, gguf_mix, values):
    """The entries of ``values`` (``{layer path: importance}``) the mix quantizes with, after refusing
    one without an entry for a ``blk.*`` matrix the mix quantizes by a weighted search.

    ``model``: a torch model or its ``ModelPlan`` (``mixle.gguf.plan``), whose layout is walked once.

    Raises:
        ValueError: a ``blk.*`` matrix the mix quantizes by a weighted search has no entry.
    """
    from mixle.gguf.imatrix_file import importance_by_tensor, require_entry
    from mixle.gguf.plan import plan_of
    from mixle.gguf.writer import gguf_mix_types

    plan = plan_of(model, "apply_qat(gguf_mix=...)")
    types, by_tensor = gguf_mix_types(plan, gguf_mix, importance=values), importance_by_tensor(plan, values)
    kept = {}
    for path, names in plan.imatrix_names.items():
        for name in names:
            require_entry(name, types[name], by_tensor)
        if path in values and any(types[name] not in (None, "F16", "F32") for name in names):
            kept[path] = values[path]  # F16/F32 (a router): unused, as in llama.cpp
    return kept
