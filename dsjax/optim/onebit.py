"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888) as DeepSpeed implements it, for `jax.shard_map`.

The one idea: after `freeze_step` exact Adam steps the second moment `v` is frozen (paper §3),
which makes Adam's update linear in the momentum; so each data-parallel worker folds its local
gradient into the momentum, and the momenta are averaged with the 1-bit all-reduce of
`dsjax.optim.compressed_allreduce`. Which update a step takes (exact or compressed) is one rule,
`OneBitAdam.uses_compression`, that every caller asks. Shapes inside the shard_map are local:
W = size of `axis_name`, L = size of `fast_axis` (1 without one), n_b = bucket b's padded length.
Leaves split over the data axes (a MoE model's routed experts under expert parallelism) are
*owned*: each device holds its own slice, whose gradient arrives complete, so they take exact
Adam in every step and never enter a bucket. State layout, the train step, MoE and where this
departs from DeepSpeed: docs/onebit.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax.optim.compressed_allreduce import (BucketPlan, compressed_mean, group_name,
                                              pad_multiple, plan_buckets)
from dsjax.sharding import DATA, varying_axes

__all__ = ["OneBitAdam", "OneBitAdamState", "onebit_adam"]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


def _spec_axes(spec: P) -> frozenset:
    axes = set()
    for entry in spec:
        axes.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    return frozenset(axes)


class OneBitAdamState(NamedTuple):
    count: jax.Array                             # int32 [] steps taken
    mu: Any                                      # float32, like params; same on every worker
    nu: Any                                      # float32, like params; frozen after freeze_step
                                                 # (owned leaves: never frozen)
    worker_error: dict[str, tuple[jax.Array, ...]]  # group -> per bucket, local [1, n_b / L]
    server_error: dict[str, tuple[jax.Array, ...]]  # group -> per bucket, local [1, n_b / (L*W)]


@dataclasses.dataclass(frozen=True)
class OneBitAdam:
    """1-bit Adam; see docs/onebit.md. Build it with `onebit_adam(...)`.

    `init`, `warmup_update` and `compressed_update` run inside `jax.shard_map` (check_vma on, the
    default) that is manual over `axis_name` (and `fast_axis`) and possibly other axes. Params
    come in replicated over the data axes; gradients are the worker's own (not reduced; each
    worker's mean over its share of the batch), typed varying over the data axes. Owned leaves
    (params split over the data axes; `state_specs(..., owned=True)` admits them) come in as
    this device's slice with their complete gradient, and take exact Adam in both phases. The
    updates return optax-style `(updates, new_state)`: `optax.apply_updates(params, updates)`.
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

    def owned(self, params: Any) -> Any:
        """Inside the shard_map: per leaf of `params` (a bool pytree), is it split over the data
        axes, i.e. owned (exact Adam, no bucket)? `state_specs` vetted the layout."""
        return jax.tree.map(lambda p: bool(varying_axes(p) & set(self.data_axes)), params)

    def plan(self, params: Any) -> BucketPlan:
        """The bucket plan for this device's `params` less the owned leaves (a list of the
        compressed leaves, in tree order); call inside the shard_map.

        Leaves split over other manual axes (e.g. "tensor") are bucketed apart from replicated
        ones: a bucket's scale must be the same on every device that holds the same values.
        """
        shared = [p for p, o in zip(jax.tree.leaves(params), jax.tree.leaves(self.owned(params)))
                  if not o]
        groups = [group_name(varying_axes(p)) for p in shared]
        w = lax.axis_size(self.axis_name)
        fast = 1 if self.fast_axis is None else lax.axis_size(self.fast_axis)
        return plan_buckets(shared, self.bucket_bytes, fast * pad_multiple(w), groups)

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

    def state_specs(self, param_specs: Any, owned: bool = False) -> OneBitAdamState:
        """shard_map in/out specs of the state, given the params' specs (a pytree of P).

        The errors of a group of leaves split over mesh axes A are P(data axes, A): global
        [W*L, |A| * n_b / L], one row block per data-parallel worker, one column block per
        shard of A. `owned`: leaves split over the data axes are owned (expert parallelism's
        experts: exact Adam, moments split like them, no errors); False: they are an error.
        """
        specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
        groups = {}
        for spec in specs:
            axes = _spec_axes(spec)
            if axes & set(self.data_axes):
                if owned:
                    continue
                raise ValueError(f"onebit_adam: a parameter spec {spec} splits over the data "
                                 f"axes; 1-bit Adam needs params replicated there (no fsdp)")
            groups[group_name(axes)] = P(self.data_axes, tuple(sorted(axes, key=str)) or None)
        return OneBitAdamState(count=P(), mu=param_specs, nu=param_specs,
                               worker_error=groups, server_error=groups)

    def _check_local(self, local_grads: Any) -> None:
        # Owned leaves vary over the data axes too (they are split over them).
        for path, g in jax.tree_util.tree_leaves_with_path(local_grads):
            if not set(self.data_axes) <= varying_axes(g):
                raise ValueError(
                    f"onebit_adam: gradient {jax.tree_util.keystr(path)} is not per-worker (not "
                    f"varying over {list(self.data_axes)}): it was already all-reduced. "
                    f"Differentiate with respect to jax.lax.pcast(params, "
                    f"{self.data_axes!r}, to='varying') inside shard_map (check_vma on).")

    def _lr(self, count: jax.Array) -> jax.Array:
        lr = self.learning_rate
        return lr(count) if callable(lr) else lr

    def _updates(self, mu: Any, nu: Any, params: Any, count_inc: jax.Array, lr: jax.Array
                 ) -> Any:
        """-lr * (m / (sqrt(v) + eps) + wd * p), term for term as optax.adamw computes it.
        Owned leaves are exact Adam: v counts every step, no bound."""
        owned = self.owned(params)
        if self.bias_correction:
            c1 = (1 - self.b1 ** count_inc).astype(jnp.float32)
            c2 = (1 - self.b2 ** self.nu_updates(count_inc)).astype(jnp.float32)
            c2_owned = (1 - self.b2 ** count_inc).astype(jnp.float32)
            mu = jax.tree.map(lambda m: m / c1, mu)
            nu = jax.tree.map(lambda v, o: v / (c2_owned if o else c2), nu, owned)
        upd = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + self.eps), mu, nu)
        if self.update_bound:  # after the freeze only: the warmup stays exactly Adam
            bound = self.adam_bound()
            upd = jax.tree.map(lambda u, o: u if o else jnp.where(
                count_inc > self.freeze_step, jnp.clip(u, -bound, bound), u), upd, owned)
        if self.weight_decay:
            mask = self.weight_decay_mask
            mask = mask(params) if callable(mask) else mask
            mask = jax.tree.map(lambda _: True, params) if mask is None else mask
            upd = jax.tree.map(lambda u, p, k: u + self.weight_decay * p if k else u,
                               upd, params, mask)
        return jax.tree.map(lambda u: -lr * u, upd)

    def mean_gradient(self, local_grads: Any, params: Any) -> Any:
        """The exact float32 mean of the workers' gradients (one float all-reduce per leaf);
        owned leaves' gradients are complete already."""
        self._check_local(local_grads)
        return jax.tree.map(lambda g, o: g.astype(jnp.float32) if o else lax.pmean(
            g.astype(jnp.float32), self.data_axes), local_grads, self.owned(params))

    def exact_update(self, grads: Any, state: OneBitAdamState, params: Any
                     ) -> tuple[Any, OneBitAdamState]:
        """Exact Adam on already averaged `grads` (e.g. `mean_gradient`'s, then clipped)."""
        mu = jax.tree.map(lambda g, m: (1 - self.b1) * g + self.b1 * m, grads, state.mu)
        keep, fresh = self.b2, 1 - self.b2
        if self.refresh_catchup and self.refresh_every:
            # A refresh step stands for the refresh_every steps since the last one: v decays
            # as Adam's would over them, and the fresh g^2 gets their combined weight. (Both
            # weights in double precision: 1 - b2^N in float32 would lose digits.) Owned
            # leaves' v took every step: plain Adam.
            after = state.count >= self.freeze_step
            keep = jnp.where(after, self.b2 ** self.refresh_every, keep)
            fresh = jnp.where(after, 1 - self.b2 ** self.refresh_every, fresh)
        nu = jax.tree.map(lambda g, v, o: (1 - self.b2) * (g ** 2) + self.b2 * v if o else
                          fresh * (g ** 2) + keep * v, grads, state.nu, self.owned(params))
        count_inc = state.count + 1
        updates = self._updates(mu, nu, params, count_inc, self._lr(state.count))
        return updates, state._replace(count=count_inc, mu=mu, nu=nu)

    def warmup_update(self, local_grads: Any, state: OneBitAdamState, params: Any
                      ) -> tuple[Any, OneBitAdamState]:
        """Exact Adam on the exact mean gradient (one float all-reduce per leaf)."""
        return self.exact_update(self.mean_gradient(local_grads, params), state, params)

    def compressed_update(self, local_grads: Any, state: OneBitAdamState, params: Any
                          ) -> tuple[Any, OneBitAdamState]:
        """Frozen v; each worker's momentum goes through the 1-bit all-reduce (paper Alg. 1).
        Owned leaves: exact Adam on their complete gradient."""
        self._check_local(local_grads)
        plan = self.plan(params)
        owned = self.owned(params)
        exact_mu = jax.tree.map(lambda g, m: (1 - self.b1) * g.astype(jnp.float32) + self.b1 * m,
                                local_grads, state.mu)
        nu = jax.tree.map(lambda g, v, o: (1 - self.b2) * (g.astype(jnp.float32) ** 2)
                          + self.b2 * v if o else v, local_grads, state.nu, owned)
        pick = lambda tree: [x for x, o in zip(jax.tree.leaves(tree), jax.tree.leaves(owned))
                             if not o]
        # m_i = b1 m + (1 - b1) g_i on each worker; the compressed mean of the m_i becomes m
        # (paper §4, Algorithm 1). Linear in g: the mean of the m_i is the momentum of the mean
        # gradient, so compressing momenta loses nothing in expectation.
        local_mu, frozen = pick(exact_mu), pick(state.nu)
        if self.compress == "update":
            # m_i / (sqrt(v) + eps): the same frozen map on every worker, undone below. v == 0
            # coordinates send 0 (they get no update; m_i / eps would swamp the bucket's scale).
            denom = [jnp.sqrt(v) + self.eps for v in frozen]
            local_mu = [jnp.where(v > 0, m / d, 0.0) for m, v, d in zip(local_mu, frozen, denom)]
            if self.update_bound:  # a coordinate whose v is stale cannot swamp the scale
                bound = self.adam_bound()
                local_mu = [jnp.clip(u, -bound, bound) for u in local_mu]
        means, worker_errors, server_errors = [], [], []
        # Dicts flatten in sorted-key order, which is the plan's bucket order.
        for buf, we, se in zip(plan.flatten(local_mu), jax.tree.leaves(state.worker_error),
                               jax.tree.leaves(state.server_error)):
            mean, we, se = compressed_mean(buf, we[0], se[0], self.axis_name, self.fast_axis)
            if not self.error_feedback:
                we, se = jnp.zeros_like(we), jnp.zeros_like(se)
            means.append(mean)
            worker_errors.append(we[None])
            server_errors.append(se[None])
        shared = plan.unflatten(means)
        if self.compress == "update":
            shared = [u * d for u, d in zip(shared, denom)]
        shared = iter(shared)
        mu = jax.tree.map(lambda m, o: m if o else next(shared), exact_mu, owned)
        count_inc = state.count + 1
        # v == 0: never had a gradient, true momentum 0 (docs/onebit.md); weight decay stays.
        seen = jax.tree.map(lambda m, v, o: m if o else jnp.where(v > 0, m, 0.0), mu, nu, owned)
        updates = self._updates(seen, nu, params, count_inc, self._lr(state.count))
        return updates, state._replace(count=count_inc, mu=mu, nu=nu,
                                       worker_error=plan.by_group(worker_errors),
                                       server_error=plan.by_group(server_errors))


def onebit_adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100_000,
                bias_correction: bool = False, bucket_bytes: int = 32 * 2**20,
                axis_name: Any = DATA, fast_axis: Any = None,
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
    momentum over the frozen sqrt(v) + eps; see docs/onebit.md). `refresh_every=N`: after
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
