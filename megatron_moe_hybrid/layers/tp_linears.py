"""Builders of the bias-free tensor-parallel projections that the attention layers share."""

from megatron.core.transformer.spec_utils import build_module


def tp_linear_builders(config, pg_collection=None):
    """(column, row): column(spec, in, out, gather_output=False) builds a column-parallel
    input projection (config.init_method), row(spec, in, out) the row-parallel output
    projection (config.output_layer_init_method, input already split, bias returned apart).
    Both use pg_collection.tp when given, else Megatron's default tensor-parallel group."""
    tp_group = getattr(pg_collection, "tp", None)
    tp_kwargs = {} if tp_group is None else {"tp_group": tp_group}

    def column(spec, in_features, out_features, gather_output=False):
        return build_module(
            spec, in_features, out_features, config=config, init_method=config.init_method,
            bias=False, gather_output=gather_output, **tp_kwargs,
        )  # fmt: skip

    def row(spec, in_features, out_features):
        return build_module(
            spec, in_features, out_features, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, **tp_kwargs,
        )  # fmt: skip

    return column, row
