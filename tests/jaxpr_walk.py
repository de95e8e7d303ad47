"""The equations of a jaxpr, its nested jaxprs included (jit, remat, custom_vjp), for tests that count them."""

import jax.extend.core


def equations(jaxpr, primitive, skip=()):
    """The equations of ``primitive`` in ``jaxpr`` and the jaxprs in its equations' parameters, except
    inside equations of a primitive named in ``skip`` (e.g. ``"cond"``'s branches)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        if eqn.primitive.name not in skip:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += equations(sub, primitive, skip)
    return found
