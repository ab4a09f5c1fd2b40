"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888) as DeepSpeed implements it, for `jax.shard_map`.

The one idea: after `freeze_step` exact Adam steps the second moment `v` has stabilised and is
frozen (paper §3), which makes Adam's update linear in the momentum; so each data-parallel worker
folds its *local* gradient into the momentum and the momentum, not the gradient, is averaged with
a 1-bit, error-compensated all-reduce (paper §4, Algorithm 1). Only signs (bit-packed) and one
float32 scale per worker and bucket cross the wire: about 1/32 of a float32 all-reduce.

Two update functions, two compiled steps: `OneBitAdam.warmup_update` (exact `pmean` of the
gradients, exact Adam) and `OneBitAdam.compressed_update` (frozen `v`, compressed momentum). The
host picks one per step with `OneBitAdam.uses_compression(step)`; nothing carries both branches.
Both, and `init`, run *inside* a `jax.shard_map` that is manual over `axis_name` (and `fast_axis`)
and may be manual over other axes too (then params and buckets are this device's shards), with
per-worker, unreduced gradients. Shapes inside are local: W = size of `axis_name`, L = size of
`fast_axis` (1 without one), n_b = bucket b's padded length.

State layout (`OneBitAdamState`), global view; `state_specs(param_specs)` gives the specs:
- `count`: int32 [], replicated. Optimizer steps taken, warmup and compressed together.
- `mu`, `nu`: float32 pytrees shaped and sharded like the params, replicated over the data axes
  (every worker holds the same values).
- `worker_error[g][b]`, `server_error[g][b]`: per-worker float32 buffers of bucket b of group g,
  where a group holds the leaves split over the same non-data mesh axes A_g ("replicated",
  "tensor", ...). Local [1, n_b / L] and [1, n_b / (L*W)]; spec P(data axes, A_g), so global
  [W*L, |A_g| * n_b / L] and [W*L, |A_g| * n_b / (L*W)]: ordinary sharded arrays that
  checkpoint like any other. They are only meaningful on the same mesh and bucket plan;
  restoring onto another data size should zero them (DeepSpeed always resets them on load and
  reports no loss of convergence).

DeepSpeed fidelity (deepspeed/runtime/fp16/onebit/adam.py, runtime/comm/nccl.py):
- DeepSpeed's `OnebitAdam` accepts `bias_correction` but its step never applies it, in warmup or
  after; `bias_correction=False` (the default) reproduces that. With `True` the warmup is
  `optax.adamw`'s arithmetic op for op (equal to a few ulps: XLA picks fused multiply-adds per
  program), and the compressed phase corrects `m` with the current step and the frozen `v` with
  `freeze_step`.
- DeepSpeed spends its first `step()` call on allocating buffers (the step counts but updates
  nothing), so its `freeze_step=F` makes F-1 exact updates; here every step updates, so F.
- DeepSpeed keeps one error buffer and one scale per tensor; here tensors are grouped into
  buckets of `bucket_bytes` (one collective pair per bucket). `bucket_bytes=0` gives one bucket
  per tensor, i.e. DeepSpeed's per-tensor scales. A bucket's scale is shared by its tensors, so
  a small tensor of large momentum next to a big quiet one is coarsely represented; the error
  feedback makes up for it over steps.
- DeepSpeed's optional `exp_avg_mask` (for momenta that are exactly zero forever) is not here.
  Instead, coordinates whose frozen `v` is exactly 0 (no gradient ever reached them before the
  freeze: e.g. embedding rows of tokens not seen yet) get no Adam update in the compressed
  phase. Their 1-bit estimate is +-scale however small their true momentum, and dividing that
  by sqrt(0) + eps would move them by lr * scale / eps per step (30 at lr 3e-3, scale 1e-4).
  DeepSpeed moves them so unless the user masks them.
- `error_feedback=False` (an ablation; DeepSpeed has no such switch) drops both errors after
  every compressed step, leaving plain, biased sign compression of the momentum.
- `compress="update"` (dsjax's default through `config.optim.compress`; DeepSpeed has only
  `"momentum"`) sends m_i / (sqrt(v) + eps) through the 1-bit all-reduce instead of m_i, and
  multiplies the mean back by sqrt(v) + eps. With v frozen and the same on every worker this is
  the same linear map on both sides, so the exact mean is unchanged; only the compression error
  moves. 1-bit compression gives every coordinate of a bucket the same magnitude (the bucket's
  RMS). In momentum space the RMS is set by the coordinates of large v, and a coordinate of
  small v (an embedding row of a rare token) receives +-RMS / sqrt(v_small) per step: many
  times its Adam step. Error feedback cancels that over later steps, but the parameter jitters
  by that much meanwhile. In update space every coordinate's exact value is O(1), so is the
  RMS, and no coordinate's error is larger than its Adam step. On cpu_tiny (mesh 2x2x2) the
  momentum run diverged after ~100 compressed steps (docs/onebit.md, Measured).
- `refresh_every=N` (0/1 Adam's variance refresh, Lu et al. 2022; DeepSpeed's OnebitAdam never
  updates v after the freeze) makes every N-th step after the freeze exact, folding that step's
  mean gradient into v. With `refresh_catchup` the refresh gets the weight of the N steps it
  stands for: v <- b2^N v + (1 - b2^N) g^2, so v follows the gradient scale as fast as Adam's.
- `update_bound` clips every coordinate of m / (sqrt(v) + eps) after the freeze (and, in update
  space, of what each worker sends) to `adam_bound()`, a bound exact Adam never reaches. A v
  frozen or refreshed from one sample can be far too small for a coordinate whose gradient has
  grown; unclipped, that coordinate's value swamps its bucket's scale and every coordinate of
  the tensor takes a huge step. On cpu_tiny, catch-up refreshes without the bound diverged at
  step ~420; with it 1-bit Adam ends 0.5% above AdamW (docs/onebit.md, Measured).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


def pad_multiple(num_workers: int) -> int:
    """Buffers are padded to W * lcm(W, 8): every worker's chunk is whole bytes of packed signs."""
    return num_workers * math.lcm(num_workers, 8)


def _sign_bits(x: jax.Array) -> jax.Array:
    # DeepSpeed takes `sign(x) + 1 != 0`: zero compresses to +1, as does `x >= 0`.
    return x >= 0


def _decompress(bits_u8: jax.Array, scales: jax.Array) -> jax.Array:
    """[R, C/8] packed signs, [R] scales -> [R, C] float32 values +-scale."""
    signs = jnp.unpackbits(bits_u8, axis=1).astype(jnp.float32) * 2.0 - 1.0
    return signs * scales[:, None]


def compressed_allreduce(x: jax.Array, worker_error: jax.Array, server_error: jax.Array,
                         axis_name: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Error-compensated 1-bit mean of `x` over `axis_name` (DeepSpeed's `compressed_allreduce`).

    Call inside `jax.shard_map`, manual over `axis_name`. `x` and `worker_error` are this worker's
    float32 [n] buffers, n a multiple of `pad_multiple(W)`; `server_error` is float32 [n / W], the
    error of the chunk this worker serves. Returns (mean estimate [n], identical on every worker
    and typed invariant over `axis_name`; new worker error [n]; new server error [n / W]).
    """
    w = lax.axis_size(axis_name)
    n = x.shape[0]
    if x.ndim != 1 or n % pad_multiple(w):
        raise ValueError(f"compressed_allreduce: x must be flat with length a multiple of "
                         f"W*lcm(W,8) = {pad_multiple(w)} (W={w}); got shape {x.shape}")
    if worker_error.shape != (n,) or server_error.shape != (n // w,):
        raise ValueError(f"compressed_allreduce: errors must be [{n}] and [{n // w}]; got "
                         f"{worker_error.shape} and {server_error.shape}")
    chunk = n // w

    # Worker compression with error compensation (paper §4, Algorithm 1): [n] -> bits [n], one
    # scale, and what the bits miss is kept for the next step.
    x = x.astype(jnp.float32) + worker_error
    scale = jnp.linalg.norm(x) / math.sqrt(n)
    bits = _sign_bits(x)
    new_worker_error = x - scale * jnp.where(bits, 1.0, -1.0)

    # Phase 1: row j of `packed` is worker j's chunk. [W, chunk/8] u8 -> [W, chunk/8] u8, row j
    # now from worker j; scales [] -> [W].
    packed = jnp.packbits(bits.reshape(w, chunk), axis=1)
    received = lax.all_to_all(packed, axis_name, 0, 0)
    scales = lax.all_gather(scale, axis_name)

    # Server: average the W decompressed copies of my chunk, add my server error, recompress.
    # [W, chunk] -> [chunk]; DeepSpeed folds the 1/W into the scales before summing.
    server_x = jnp.sum(_decompress(received, scales / w), axis=0) + server_error
    server_scale = jnp.linalg.norm(server_x) / math.sqrt(chunk)
    server_bits = _sign_bits(server_x)
    new_server_error = server_x - server_scale * jnp.where(server_bits, 1.0, -1.0)

    # Phase 2: every worker gets every chunk. [chunk/8] u8 -> [W, chunk/8]; [] -> [W]. Typed
    # invariant: all workers hold the same result, so it may leave shard_map unstacked.
    all_bits = lax.all_gather(jnp.packbits(server_bits), axis_name, to="invarying")
    all_scales = lax.all_gather(server_scale, axis_name, to="invarying")
    mean = _decompress(all_bits, all_scales).reshape(n)
    return mean, new_worker_error, new_server_error


# ------------------------------------------------------------------------------------ buckets

REPLICATED = "replicated"


def group_name(axes: Any) -> str:
    """Error-buffer group of a leaf that is split over mesh `axes` (besides the data axes)."""
    return "+".join(sorted(str(a) for a in axes)) if axes else REPLICATED


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """How the leaves of a pytree are packed into flat float32 buckets (static, hashable).

    `buckets[b]` lists leaf indices (tree-flatten order), concatenated in that order and
    zero-padded to `padded[b]`. Buckets never mix groups (leaves split over different mesh
    axes) and are ordered by `groups[b]`, so a dict keyed by group flattens in bucket order.
    """
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[str, ...]
    buckets: tuple[tuple[int, ...], ...]
    padded: tuple[int, ...]

    def flatten(self, tree: Any) -> list[jax.Array]:
        """Pytree -> one float32 [padded[b]] buffer per bucket."""
        leaves = jax.tree.leaves(tree)
        out = []
        for idx, size in zip(self.buckets, self.padded):
            parts = [leaves[i].astype(jnp.float32).reshape(-1) for i in idx]
            used = sum(p.shape[0] for p in parts)
            parts.append(jnp.zeros((size - used,), jnp.float32))
            out.append(jnp.concatenate(parts))
        return out

    def unflatten(self, buffers: Sequence[jax.Array]) -> Any:
        """Inverse of `flatten` (drops the padding); float32 leaves."""
        leaves: list[Any] = [None] * len(self.shapes)
        for idx, buf in zip(self.buckets, buffers):
            start = 0
            for i in idx:
                size = math.prod(self.shapes[i])
                leaves[i] = buf[start:start + size].reshape(self.shapes[i])
                start += size
        return jax.tree.unflatten(self.treedef, leaves)

    def by_group(self, per_bucket: Sequence[Any]) -> dict[str, tuple[Any, ...]]:
        """[one per bucket] -> {group: (one per bucket of the group)}."""
        out: dict[str, list[Any]] = {}
        for group, x in zip(self.groups, per_bucket):
            out.setdefault(group, []).append(x)
        return {g: tuple(v) for g, v in out.items()}


def plan_buckets(tree: Any, bucket_bytes: int, multiple: int,
                 groups: Sequence[str] | None = None) -> BucketPlan:
    """Groups consecutive leaves of one group into buckets of at most `bucket_bytes` bytes.

    A leaf larger than `bucket_bytes` gets a bucket of its own (leaves are never split);
    `bucket_bytes=0` puts every leaf in its own bucket. Each bucket is padded to `multiple`.
    `groups`: one name per leaf (default: all `REPLICATED`).
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in leaves)
    groups = [REPLICATED] * len(leaves) if groups is None else list(groups)
    names, buckets = [], []
    for group in sorted(set(groups)):
        used, start = 0, len(buckets)
        for i in (i for i, g in enumerate(groups) if g == group):
            nbytes = 4 * math.prod(shapes[i])
            if len(buckets) == start or used + nbytes > bucket_bytes:
                buckets.append([])
                names.append(group)
                used = 0
            buckets[-1].append(i)
            used += nbytes
    sizes = [sum(math.prod(shapes[i]) for i in b) for b in buckets]
    padded = tuple(max(multiple, -(-s // multiple) * multiple) for s in sizes)
    return BucketPlan(treedef, shapes, tuple(names), tuple(tuple(b) for b in buckets), padded)


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` may differ inside shard_map (its varying manual axes)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def tree_sq_norm(tree: Any, skip_axes: Sequence = ()) -> jax.Array:
    """Inside shard_map: the squared L2 norm of the whole tree this device holds shards of.

    Each leaf's local sum of squares is summed over the mesh axes that leaf varies over (the axes
    that split it), except `skip_axes`. Per-worker gradients with `skip_axes` = the data axes
    give each worker the squared norm of its own gradient; a mean gradient, the global one.
    """
    sums: dict[tuple, jax.Array] = {}
    for x in jax.tree.leaves(tree):
        axes = tuple(sorted(_varying_axes(x) - set(skip_axes), key=str))
        sums[axes] = sums.get(axes, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
    total = jnp.zeros([], jnp.float32)
    for axes, part in sums.items():
        total = total + (lax.psum(part, axes) if axes else part)
    return total


def _spec_axes(spec: P) -> frozenset:
    axes = set()
    for entry in spec:
        axes.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    return frozenset(axes)


# ---------------------------------------------------------------------------------- optimizer

class OneBitAdamState(NamedTuple):
    count: jax.Array                             # int32 [] steps taken
    mu: Any                                      # float32, like params; same on every worker
    nu: Any                                      # float32, like params; frozen after freeze_step
    worker_error: dict[str, tuple[jax.Array, ...]]  # group -> per bucket, local [1, n_b / L]
    server_error: dict[str, tuple[jax.Array, ...]]  # group -> per bucket, local [1, n_b / (L*W)]


@dataclasses.dataclass(frozen=True)
class OneBitAdam:
    """1-bit Adam; see the module docstring. Build it with `onebit_adam(...)`.

    `init`, `warmup_update` and `compressed_update` run inside `jax.shard_map` (check_vma on, the
    default) that is manual over `axis_name` (and `fast_axis`) and possibly other axes. Params
    come in replicated over the data axes; gradients are the worker's own (not reduced; each
    worker's mean over its share of the batch), typed varying over the data axes. The updates
    return optax-style `(updates, new_state)`: `optax.apply_updates(params, updates)`.
    """
    learning_rate: ScalarOrSchedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    weight_decay_mask: Any
    freeze_step: int
    bias_correction: bool
    bucket_bytes: int
    axis_name: Any
    fast_axis: Any
    error_feedback: bool = True
    compress: str = "momentum"  # what the 1-bit all-reduce carries: "momentum" | "update"
    refresh_every: int = 0  # after the freeze, every N-th step is exact and updates v (0: never)
    refresh_catchup: bool = False  # a refresh weighs g^2 as the N steps since the last one
    update_bound: bool = False  # after the freeze, |m / sqrt(v)| <= what exact Adam can reach

    @property
    def data_axes(self) -> tuple:
        """The mesh axes the gradients are averaged over (the leading axis of the errors)."""
        return (self.axis_name,) if self.fast_axis is None else (self.axis_name, self.fast_axis)

    def uses_compression(self, step: int) -> bool:
        """Host side: does the step after `step` completed steps use `compressed_update`?

        With `refresh_every=N` the N-th, 2N-th, ... step after the freeze is an exact one
        (`warmup_update`), which folds the exact mean gradient into `v` (and `m`).
        """
        step = int(step)
        if step < self.freeze_step:
            return False
        return not self.refresh_every or (step - self.freeze_step + 1) % self.refresh_every != 0

    def adam_bound(self) -> float:
        """A bound on |m / sqrt(v)| that exact Adam never exceeds (no bias correction; b1 <
        sqrt(b2)): only a stale `v` (frozen, or refreshed now and then) can.

        |m_t| <= (1 - b1) sum_k b1^k |g_{t-k}| and v_t >= (1 - b2) b2^k g_{t-k}^2 for each k, so
        |m_t| / sqrt(v_t) <= (1 - b1) / sqrt(1 - b2) * sum_k (b1 / sqrt(b2))^k: 5.84 for (0.9,
        0.95), 31.8 for (0.9, 0.999). It is loose: Cauchy-Schwarz gives the least bound,
        (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) = 1.17 for (0.9, 0.95); cpu_tiny's
        measurements (docs/onebit.md) are with this one, the tight one is untried.
        """
        b1, b2 = self.b1, self.b2
        return (1 - b1) / (math.sqrt(1 - b2) * (1 - b1 / math.sqrt(b2)))

    def nu_updates(self, count: jax.Array) -> jax.Array:
        """How many steps have folded a gradient into `v` after `count` steps (bias correction)."""
        if not self.refresh_every:
            return jnp.minimum(count, self.freeze_step)
        after = jnp.maximum(count - self.freeze_step, 0)
        # refresh_catchup: a refresh weighs like the refresh_every steps it stands for.
        per_refresh = self.refresh_every if self.refresh_catchup else 1
        return (jnp.minimum(count, self.freeze_step)
                + per_refresh * (after // self.refresh_every))

    def plan(self, params: Any) -> BucketPlan:
        """The bucket plan for this device's `params`; call inside the shard_map.

        Leaves split over other manual axes (e.g. "tensor") are bucketed apart from replicated
        ones: a bucket's scale must be the same on every device that holds the same values.
        """
        groups = []
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            axes = _varying_axes(p)
            if axes & set(self.data_axes):
                raise ValueError(
                    f"onebit_adam: parameter {jax.tree_util.keystr(path)} differs across "
                    f"{sorted(axes & set(self.data_axes))}; 1-bit Adam needs params replicated "
                    f"over the data axes (turn mesh.fsdp off)")
            groups.append(group_name(axes))
        w = lax.axis_size(self.axis_name)
        fast = 1 if self.fast_axis is None else lax.axis_size(self.fast_axis)
        return plan_buckets(params, self.bucket_bytes, fast * pad_multiple(w), groups)

    def init(self, params: Any) -> OneBitAdamState:
        plan = self.plan(params)
        w = lax.axis_size(self.axis_name)
        fast = 1 if self.fast_axis is None else lax.axis_size(self.fast_axis)
        zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), t)
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros(params), nu=zeros(params),
            worker_error=plan.by_group([jnp.zeros((1, n // fast), jnp.float32)
                                        for n in plan.padded]),
            server_error=plan.by_group([jnp.zeros((1, n // (fast * w)), jnp.float32)
                                        for n in plan.padded]))

    def state_specs(self, param_specs: Any) -> OneBitAdamState:
        """shard_map in/out specs of the state, given the params' specs (a pytree of P).

        The errors of a group of leaves split over mesh axes A are P(data axes, A): global
        [W*L, |A| * n_b / L], one row block per data-parallel worker, one column block per
        shard of A.
        """
        specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
        groups = {}
        for spec in specs:
            axes = _spec_axes(spec)
            if axes & set(self.data_axes):
                raise ValueError(f"onebit_adam: a parameter spec {spec} splits over the data "
                                 f"axes; 1-bit Adam needs params replicated there (no fsdp)")
            groups[group_name(axes)] = P(self.data_axes, tuple(sorted(axes, key=str)) or None)
        return OneBitAdamState(count=P(), mu=param_specs, nu=param_specs,
                               worker_error=groups, server_error=groups)

    def _check_local(self, local_grads: Any) -> None:
        for path, g in jax.tree_util.tree_leaves_with_path(local_grads):
            if not set(self.data_axes) <= _varying_axes(g):
                raise ValueError(
                    f"onebit_adam: gradient {jax.tree_util.keystr(path)} is not per-worker (not "
                    f"varying over {list(self.data_axes)}): it was already all-reduced. "
                    f"Differentiate with respect to jax.lax.pcast(params, "
                    f"{self.data_axes!r}, to='varying') inside shard_map (check_vma on).")

    def _lr(self, count: jax.Array) -> jax.Array:
        lr = self.learning_rate
        return lr(count) if callable(lr) else lr

    def _updates(self, mu: Any, nu: Any, params: Any, count_inc: jax.Array,
                 nu_count: jax.Array, lr: jax.Array) -> Any:
        """-lr * (m / (sqrt(v) + eps) + wd * p), term for term as optax.adamw computes it."""
        if self.bias_correction:
            c1 = (1 - self.b1 ** count_inc).astype(jnp.float32)
            c2 = (1 - self.b2 ** nu_count).astype(jnp.float32)
            mu = jax.tree.map(lambda m: m / c1, mu)
            nu = jax.tree.map(lambda v: v / c2, nu)
        upd = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + self.eps), mu, nu)
        if self.update_bound:  # after the freeze only: the warmup stays exactly Adam
            bound = self.adam_bound()
            upd = jax.tree.map(lambda u: jnp.where(count_inc > self.freeze_step,
                                                   jnp.clip(u, -bound, bound), u), upd)
        if self.weight_decay:
            mask = self.weight_decay_mask
            mask = mask(params) if callable(mask) else mask
            mask = jax.tree.map(lambda _: True, params) if mask is None else mask
            upd = jax.tree.map(lambda u, p, k: u + self.weight_decay * p if k else u,
                               upd, params, mask)
        return jax.tree.map(lambda u: -lr * u, upd)

    def mean_gradient(self, local_grads: Any) -> Any:
        """The exact float32 mean of the workers' gradients (one float all-reduce per leaf)."""
        self._check_local(local_grads)
        return lax.pmean(jax.tree.map(lambda g: g.astype(jnp.float32), local_grads),
                         self.data_axes)

    def exact_update(self, grads: Any, state: OneBitAdamState, params: Any
                     ) -> tuple[Any, OneBitAdamState]:
        """Exact Adam on already averaged `grads` (e.g. `mean_gradient`'s, then clipped)."""
        mu = jax.tree.map(lambda g, m: (1 - self.b1) * g + self.b1 * m, grads, state.mu)
        keep, fresh = self.b2, 1 - self.b2
        if self.refresh_catchup and self.refresh_every:
            # A refresh step stands for the refresh_every steps since the last one: v decays
            # as Adam's would over them, and the fresh g^2 gets their combined weight. (Both
            # weights in double precision: 1 - b2^N in float32 would lose digits.)
            after = state.count >= self.freeze_step
            keep = jnp.where(after, self.b2 ** self.refresh_every, keep)
            fresh = jnp.where(after, 1 - self.b2 ** self.refresh_every, fresh)
        nu = jax.tree.map(lambda g, v: fresh * (g ** 2) + keep * v, grads, state.nu)
        count_inc = state.count + 1
        updates = self._updates(mu, nu, params, count_inc, self.nu_updates(count_inc),
                                self._lr(state.count))
        return updates, state._replace(count=count_inc, mu=mu, nu=nu)

    def warmup_update(self, local_grads: Any, state: OneBitAdamState, params: Any
                      ) -> tuple[Any, OneBitAdamState]:
        """Exact Adam on the exact mean gradient (one float all-reduce per leaf)."""
        return self.exact_update(self.mean_gradient(local_grads), state, params)

    def compressed_update(self, local_grads: Any, state: OneBitAdamState, params: Any
                          ) -> tuple[Any, OneBitAdamState]:
        """Frozen v; each worker's momentum goes through the 1-bit all-reduce (paper Alg. 1)."""
        self._check_local(local_grads)
        plan = self.plan(params)
        # m_i = b1 m + (1 - b1) g_i on each worker; the compressed mean of the m_i becomes m
        # (paper §4, Algorithm 1). Linear in g: the mean of the m_i is the momentum of the mean
        # gradient, so compressing momenta loses nothing in expectation.
        local_mu = jax.tree.map(lambda g, m: (1 - self.b1) * g.astype(jnp.float32) + self.b1 * m,
                                local_grads, state.mu)
        if self.compress == "update":
            # m_i / (sqrt(v) + eps): the same frozen map on every worker, undone below. v == 0
            # coordinates send 0 (they get no update; m_i / eps would swamp the bucket's scale).
            denom = jax.tree.map(lambda v: jnp.sqrt(v) + self.eps, state.nu)
            local_mu = jax.tree.map(lambda m, v, d: jnp.where(v > 0, m / d, 0.0),
                                    local_mu, state.nu, denom)
            if self.update_bound:  # a coordinate whose v is stale cannot swamp the scale
                bound = self.adam_bound()
                local_mu = jax.tree.map(lambda u: jnp.clip(u, -bound, bound), local_mu)
        means, worker_errors, server_errors = [], [], []
        # Dicts flatten in sorted-key order, which is the plan's bucket order.
        for buf, we, se in zip(plan.flatten(local_mu), jax.tree.leaves(state.worker_error),
                               jax.tree.leaves(state.server_error)):
            mean, we, se = self._reduce(buf, we[0], se[0])
            if not self.error_feedback:
                we, se = jnp.zeros_like(we), jnp.zeros_like(se)
            means.append(mean)
            worker_errors.append(we[None])
            server_errors.append(se[None])
        mu = plan.unflatten(means)
        if self.compress == "update":
            mu = jax.tree.map(lambda u, d: u * d, mu, denom)
        count_inc = state.count + 1
        # v == 0: never had a gradient, true momentum 0 (module docstring); weight decay stays.
        seen = jax.tree.map(lambda m, v: jnp.where(v > 0, m, 0.0), mu, state.nu)
        updates = self._updates(seen, state.nu, params, count_inc, self.nu_updates(count_inc),
                                self._lr(state.count))
        return updates, state._replace(count=count_inc, mu=mu,
                                       worker_error=plan.by_group(worker_errors),
                                       server_error=plan.by_group(server_errors))

    def _reduce(self, buf: jax.Array, worker_error: jax.Array, server_error: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.fast_axis is None:
            return compressed_allreduce(buf, worker_error, server_error, self.axis_name)
        # Hierarchical: exact mean over the fast (intra-node) axis, each of the L devices keeping
        # 1/L of the buffer; 1-bit across nodes on that slice; exact all-gather back in the node.
        # [n] -> [n/L]
        fast = lax.axis_size(self.fast_axis)
        part = lax.psum_scatter(buf, self.fast_axis, tiled=True) / fast
        mean, worker_error, server_error = compressed_allreduce(part, worker_error, server_error,
                                                                self.axis_name)
        # [n/L] -> [n]
        mean = lax.all_gather(mean, self.fast_axis, tiled=True, to="invarying")
        return mean, worker_error, server_error


def onebit_adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100_000,
                bias_correction: bool = False, bucket_bytes: int = 32 * 2**20,
                axis_name: Any = "data", fast_axis: Any = None,
                weight_decay_mask: Any = None, error_feedback: bool = True,
                compress: str = "momentum", refresh_every: int = 0,
                refresh_catchup: bool = False, update_bound: bool = False) -> OneBitAdam:
    """1-bit Adam with DeepSpeed's defaults (freeze_step=100000, no bias correction).

    `learning_rate` is a float or a schedule of the number of steps taken; `weight_decay` is
    decoupled (`+ wd * p` inside the lr product, as DeepSpeed and optax.adamw), applied where
    `weight_decay_mask` (a bool pytree or a function of params; None: everywhere) is True.
    `fast_axis`: the intra-node mesh axis for the hierarchical reduction (exact inside a node,
    1-bit across nodes over `axis_name`). `error_feedback=False` zeroes the error buffers after
    every compressed step (an ablation). `compress`: "momentum" (DeepSpeed) or "update" (the
    momentum over the frozen sqrt(v) + eps; see the module docstring). `refresh_every=N`: after
    the freeze every N-th step is exact Adam (exact mean gradient, v updated), as 0/1 Adam
    (Lu et al. 2022) refreshes v; 0 keeps v frozen (DeepSpeed). `refresh_catchup`: a refresh
    folds g^2 into v with weight 1 - b2^N instead of 1 - b2 (v then follows the gradient scale
    like Adam's). `update_bound`: after the freeze every coordinate of m / (sqrt(v) + eps) (and,
    with compress="update", of what each worker sends) is clipped to `adam_bound()`, which exact
    Adam never exceeds; off reproduces DeepSpeed.
    """
    if freeze_step < 0:
        raise ValueError(f"onebit_adam: freeze_step must be >= 0, got {freeze_step}")
    if bucket_bytes < 0:
        raise ValueError(f"onebit_adam: bucket_bytes must be >= 0, got {bucket_bytes}")
    if compress not in ("momentum", "update"):
        raise ValueError(f"onebit_adam: compress must be 'momentum' or 'update', got {compress!r}")
    if refresh_every < 0 or refresh_every == 1:
        raise ValueError(f"onebit_adam: refresh_every must be 0 (off) or >= 2, got "
                         f"{refresh_every}")
    if update_bound and not b1 < math.sqrt(b2):
        raise ValueError(f"onebit_adam: update_bound needs b1 < sqrt(b2) (else Adam's update "
                         f"has no bound), got b1={b1}, b2={b2}")
    if fast_axis is not None and fast_axis == axis_name:
        raise ValueError(f"onebit_adam: fast_axis must differ from axis_name ({axis_name!r})")
    return OneBitAdam(learning_rate, b1, b2, eps, weight_decay, weight_decay_mask, freeze_step,
                      bias_correction, bucket_bytes, axis_name, fast_axis, error_feedback,
                      compress, refresh_every, refresh_catchup, update_bound)
