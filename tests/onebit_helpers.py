"""What the 1-bit Adam tests share: the 8-worker data mesh, a NumPy transcription of DeepSpeed's
compressed all-reduce (float64), small parameter trees, exactly summable gradients, and the
jitted shard_map init and step of the optimizer."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from dsjax.optim.compressed_allreduce import compressed_allreduce
from dsjax.optim.onebit import OneBitAdam

W = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), axis_types=(AxisType.Auto,))


def np_compressed_allreduce(x, worker_error, server_error):
    """DeepSpeed's NcclBackend.compressed_allreduce for all workers at once, in float64.

    x, worker_error: [W, n]; server_error: [W, n/W]. Returns (mean [n], worker_error, server_error).
    """
    x = x.astype(np.float64) + worker_error
    w, n = x.shape
    chunk = n // w
    scale = np.linalg.norm(x, axis=1) / np.sqrt(n)                    # [W]
    bits = x >= 0
    new_worker_error = x - scale[:, None] * np.where(bits, 1.0, -1.0)
    # Phase 1: worker j receives the packed bits of chunk j from every worker i.
    packed = np.packbits(bits.reshape(w, w, chunk), axis=2)            # [from i, chunk j, c/8]
    server_x = np.empty((w, chunk))
    for j in range(w):
        signs = np.unpackbits(packed[:, j], axis=1) * 2.0 - 1.0        # [from i, chunk]
        server_x[j] = (signs * (scale[:, None] / w)).sum(0) + server_error[j]
    server_scale = np.linalg.norm(server_x, axis=1) / np.sqrt(chunk)   # [W]
    server_bits = server_x >= 0
    new_server_error = server_x - server_scale[:, None] * np.where(server_bits, 1.0, -1.0)
    # Phase 2: everyone gathers every server's packed chunk and scale.
    gathered = np.packbits(server_bits, axis=1)
    mean = ((np.unpackbits(gathered, axis=1) * 2.0 - 1.0) * server_scale[:, None]).reshape(n)
    return mean, new_worker_error, new_server_error


def allreduce_fn(mesh):
    """jit(shard_map(compressed_allreduce)) on stacked [W, ...] inputs; mean stacked per worker."""
    def f(x, we, se):
        mean, we, se = compressed_allreduce(x[0], we[0], se[0], "data")
        return mean[None], we[None], se[None]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 3,
                                 out_specs=(P("data"),) * 3))


def small_params(rng):
    return {"dense": {"kernel": rng.normal(size=(24, 40)).astype(np.float32),
                      "bias": rng.normal(size=(40,)).astype(np.float32)},
            "norm": {"scale": (1 + 0.1 * rng.normal(size=(24,))).astype(np.float32)},
            "embed": rng.normal(size=(50, 24)).astype(np.float32)}


def dyadic_grads(rng, params, steps):
    """[steps, W, ...] per-worker gradients that are multiples of 2^-10 below 1 in magnitude: any
    sum of 8 of them, and the mean, is exact in float32 in any order, so the pmean inside
    shard_map and np.mean agree bit for bit and the comparison isolates the Adam arithmetic."""
    return jax.tree.map(
        lambda p: (rng.integers(-1023, 1024, size=(steps, W) + p.shape) / 1024.0
                   ).astype(np.float32), params)


def step_fn(mesh, opt: OneBitAdam, compressed: bool, params_like):
    """jit(shard_map(update + apply)) taking per-worker gradients stacked on a leading W axis."""
    pspecs = jax.tree.map(lambda _: P(), params_like)
    sspecs = opt.state_specs(pspecs)
    update = opt.compressed_update if compressed else opt.warmup_update

    def step(grads_w, state, params):
        local = jax.tree.map(lambda g: g[0], grads_w)
        updates, state = update(local, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), sspecs, pspecs),
                                 out_specs=(pspecs, sspecs)))


def init_fn(mesh, opt: OneBitAdam, params_like):
    pspecs = jax.tree.map(lambda _: P(), params_like)
    return jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(pspecs,),
                                 out_specs=opt.state_specs(pspecs)))
