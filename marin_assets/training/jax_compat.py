"""Levanter 1.2.dev1644 and haliax 1.4.dev453 on a newer JAX than the lock's 0.7.2.

A TPU host comes with its own JAX (0.10.x) and cannot change it, and these releases of Levanter and
haliax break there in three places. `install` mends them from outside, in the training, eval and
export processes, before Levanter builds anything (docs/training.md, "JAX versions"):

- a float loss mask: JAX 0.7 cast a non-boolean ``where=`` of ``jnp.mean`` to bool (with a deprecation
  warning); JAX 0.10 raises. Levanter passes its float loss mask to haliax's ``maybe_reduce_loss``,
  which the fix gives the mask as JAX 0.7 read it, ``mask.astype(bool)``: the same loss.
- the data loader's CPU mesh: ``jax.make_mesh`` now makes Explicit axes, and Levanter's
  ``local_cpu_mesh`` then mismatches the Auto axes of examples built under the training mesh; the fix
  makes that one mesh with Auto axes, as JAX 0.7 did.
- evaluation arrays off the CPU: an array made under the training mesh now lives on all its devices
  (the accelerator), and the loader's jitted ``stack_tree``, run under the CPU mesh, refuses it; the
  fix copies such leaves to the CPU mesh's device first.

Each fix is installed only where JAX shows the behaviour it mends (the first by a probe, the other two
on JAX past 0.7, and they act only on an Explicit mesh or an array off the CPU device), so the locked
JAX runs Levanter untouched. Each checks first that the function it wraps still has the shape it was
written for, and refuses in one line (`JaxCompatError`) if not. Nothing here touches a device, so
``jax.distributed`` can still start after it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

_installed: tuple[str, ...] | None = None


class JaxCompatError(RuntimeError):
    """A Levanter or haliax function a fix wraps no longer has the shape the fix was written for."""


def install() -> tuple[str, ...]:
    """Install the fixes this JAX needs (once per process); returns the names of their functions."""
    global _installed
    if _installed is None:
        _installed = _install()
    return _installed


def _install() -> tuple[str, ...]:
    import jax

    fixes = [fix_loss_mask] if float_where_refused() else []
    if jax.__version_info__ >= (0, 8):
        fixes += [fix_cpu_mesh, fix_stack_tree]
    for fix in fixes:
        fix()
    return tuple(fix.__name__ for fix in fixes)


def float_where_refused() -> bool:
    """Whether ``jnp.mean`` refuses a float ``where`` (traced abstractly: no device is touched)."""
    import jax
    import jax.numpy as jnp

    values = jax.ShapeDtypeStruct((2,), jnp.float32)
    try:
        jax.eval_shape(lambda a, mask: jnp.mean(a, where=mask), values, values)
    except ValueError:
        return True
    return False


def _check_parameters(fn: Callable, name: str, expected: tuple[str, ...]) -> None:
    names = tuple(inspect.signature(fn).parameters)
    if names != expected:
        raise JaxCompatError(f"jax_compat: {name} takes {names}, not {expected} as the fix for this JAX expects; "
                             "check marin_assets/training/jax_compat.py against this Levanter/haliax")


def fix_loss_mask() -> None:
    import haliax.nn.loss

    maybe_reduce_loss = haliax.nn.loss.maybe_reduce_loss
    _check_parameters(maybe_reduce_loss, "haliax.nn.loss.maybe_reduce_loss",
                      ("arr", "reduction", "reduction_axis", "where"))

    @functools.wraps(maybe_reduce_loss)
    def maybe_reduce_loss_with_bool_mask(arr, reduction, reduction_axis, where):
        if where is not None and where.dtype != bool:
            where = where.astype(bool)  # what JAX 0.7's reductions did with a float mask
        return maybe_reduce_loss(arr, reduction, reduction_axis, where)

    # Levanter calls it as hax.nn.loss.maybe_reduce_loss, haliax's losses by module global: both see this.
    haliax.nn.loss.maybe_reduce_loss = maybe_reduce_loss_with_bool_mask


def fix_cpu_mesh() -> None:
    """Levanter's loader, packing and mixture modules each imported ``local_cpu_mesh`` by name, so the
    generator inside that one context manager object is replaced, and every importer sees the fix."""
    from levanter.utils import jax_utils

    manager = jax_utils.local_cpu_mesh
    original = getattr(manager, "__wrapped__", None)
    cells = manager.__closure__ or ()
    if (original is None or len(cells) != 1 or cells[0].cell_contents is not original
            or "make_mesh" not in original.__code__.co_names):
        raise JaxCompatError("jax_compat: levanter.utils.jax_utils.local_cpu_mesh is no longer the contextmanager "
                             "around jax.make_mesh that the fix for this JAX replaces; check "
                             "marin_assets/training/jax_compat.py against this Levanter")
    _check_parameters(original, "levanter.utils.jax_utils.local_cpu_mesh", ())
    cells[0].cell_contents = _with_auto_axes(original)


def _with_auto_axes(local_cpu_mesh: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
    import haliax
    from jax.sharding import AxisType, Mesh

    @functools.wraps(local_cpu_mesh)
    def local_cpu_mesh_with_auto_axes():
        with contextlib.contextmanager(local_cpu_mesh)() as mesh:
            if AxisType.Explicit not in mesh.axis_types:
                yield mesh
                return
            auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
            with haliax.partitioning.set_mesh(auto):  # inside the original's: its CPU device stays the default
                yield auto

    return local_cpu_mesh_with_auto_axes


def fix_stack_tree() -> None:
    from levanter.data import loader

    stack_tree = loader.stack_tree
    _check_parameters(stack_tree, "levanter.data.loader.stack_tree", ("batch_name", "individual_datums"))

    @functools.wraps(stack_tree)
    def stack_tree_on_mesh_device(batch_name, individual_datums):
        return stack_tree(batch_name, _on_context_device(individual_datums))

    # Both of Levanter's callers (the batch loader and stack_batches) look it up as a module global.
    loader.stack_tree = stack_tree_on_mesh_device


def _on_context_device(tree):
    """``tree`` with its arrays that live elsewhere copied to the device of the one-device mesh in context
    (the loader's CPU mesh); unchanged under any other mesh."""
    import jax
    from haliax.partitioning import _resolve_mesh

    mesh = _resolve_mesh()
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.devices.size != 1:
        return tree
    device = mesh.devices.flat[0]

    def move(leaf):
        if isinstance(leaf, jax.Array) and leaf.devices() != {device}:
            return jax.device_put(leaf, device)
        return leaf

    return jax.tree.map(move, tree)
